"""A flat allreduce run's ranks find their group through the driver's parameter server
(worker.distributed.MeetingAtPS over pipeline.ps.server.meeting): a real server, real clients, ranks in threads."""
import socket
import threading

import pytest
import torch

from pipeline.ps import OptimizerSpec, ParameterServer, PSClient, PSSettings, new_secret
from pipeline.wire.deadline import CONNECT_KEY, STEP_KEY, Timeout
from pipeline.worker.distributed import MeetingAtPS, Rendezvous

HOST = "127.0.0.1"


def _meet(devices):
    """Each rank's MeetingAtPS.joined(...) outcome: (Rendezvous, whether rank 0's store answered inside the
    block, whether it still answered after), or the exception it raised."""
    secret = new_secret()
    settings = PSSettings(optimizer=OptimizerSpec(name="sgd", lr=0.1), step_timeout=Timeout.of(20, STEP_KEY))
    outcomes: dict[int, object] = {}
    with ParameterServer(torch.zeros(4), settings, world_size=len(devices), secret=secret, host=HOST) as server:
        def rank_main(rank):
            meeting = MeetingAtPS(HOST, secret, 1, Timeout.of(5, CONNECT_KEY))
            try:
                with PSClient(*server.address, rank=rank, secret=secret, timeout_s=20) as client:
                    client.connect()
                    with meeting.joined(client, rank, devices[rank]) as found:
                        inside = _answers(found.host, found.port)
                    outcomes[rank] = (found, inside, _answers(found.host, found.port))
                    client.finish()
            except Exception as exc:  # noqa: BLE001 - handed back to the test
                outcomes[rank] = exc

        threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(len(devices))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    return outcomes


def _answers(host, port):
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def test_every_rank_meets_at_rank_0s_store_which_is_served_for_the_block():
    outcomes = _meet(["cpu", "cpu", "cpu"])
    found = [outcomes[r][0] for r in range(3)]
    assert all(isinstance(f, Rendezvous) for f in found)
    assert len({(f.host, f.port) for f in found}) == 1 and found[0].host == HOST
    assert found[0].timeout.key == CONNECT_KEY and found[0].secret and found[0].generation == 1
    assert outcomes[0][1] is True  # rank 0's store listens while its block runs...
    assert outcomes[0][2] is False  # ...and is closed when it ends


def test_a_group_of_cpu_and_cuda_ranks_fails_on_every_rank_naming_it():
    outcomes = _meet(["cpu", "cuda:0"])
    for rank in (0, 1):
        error = outcomes[rank]
        assert isinstance(error, RuntimeError), error
        assert "mixes devices: rank(s) [1] train on CUDA" in str(error)
