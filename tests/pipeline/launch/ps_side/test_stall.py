"""The stall watch against a real parameter server and real clients: a rank that goes quiet while its peer
waits in a synchronous step is named with its host, and counted per rank for the epoch row."""
import logging
import threading
import time

import torch

from pipeline.launch.ps_side.stall import StallWatch
from pipeline.ps import OptimizerSpec, PSClient, ParameterServer, PSSettings, new_secret
from pipeline.wire.deadline import STEP_KEY, Timeout


def _server(secret):
    settings = PSSettings(OptimizerSpec(lr=0.1), step_timeout=Timeout.of(20, STEP_KEY))
    return ParameterServer(torch.zeros(8), settings, world_size=2, secret=secret, host="127.0.0.1")


def _watch(server, notes):
    return StallWatch(server, 2, stall_s=0.4, step=Timeout(20, STEP_KEY), poll_s=0.05, show=notes.append,
                      next_step=lambda: "attempt 2 of 3 (train.max_attempts) starts from the PS state")


def test_a_rank_silent_while_its_peer_waits_is_named_with_its_host_and_counted(caplog):
    caplog.set_level(logging.INFO, logger="pipeline.launch.ps_side.stall")
    secret, notes = new_secret(), []
    with _server(secret) as server:
        fast = PSClient(*server.address, rank=0, secret=secret, timeout_s=20)
        slow = PSClient(*server.address, rank=1, secret=secret, timeout_s=20)
        try:
            fast.connect()
            slow.connect()
            watch = _watch(server, notes)
            with watch:
                # rank 0 pushes step 0 and waits for rank 1 inside the synchronous step: it is in a request
                waiting = threading.Thread(target=fast.push_pull, args=(0, torch.ones(8)), daemon=True)
                waiting.start()
                time.sleep(1.2)  # rank 1 says nothing: silent past stall_s=0.4 for ~0.8 s
                assert server.silences[0][0] == 0.0  # the waiting rank is not silent
                silent, host = server.silences[1]
                assert silent >= 1.0 and host == "127.0.0.1"
                slow.push_pull(0, torch.ones(8))
                waiting.join(10)
                time.sleep(0.3)  # a poll sees rank 1 heard again
            metrics = watch.epoch_metrics()
            fast.finish()
            slow.finish()
        finally:
            fast.close()
            slow.close()
    warnings = [r.getMessage() for r in caplog.records if "silent for" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert "rank(s) 1 on host 127.0.0.1 silent for" in warnings[0]
    assert "timeouts.stall_s=0.4" in warnings[0] and "rank(s) [0] wait for them" in warnings[0]
    assert "timeouts.step_s=20s" in warnings[0] and "attempt 2 of 3" in warnings[0]
    assert "rank 1 on host 127.0.0.1 was heard from again after" in caplog.text
    assert metrics["rank0/stall_s"] == 0.0
    assert 1.0 <= metrics["rank1/stall_s"] <= 1.8, metrics  # the whole silence, once it passed the threshold
    assert notes[0].startswith("silent: rank 1") and notes[-1] is None  # the step bar's note, set then cleared


def test_a_silence_still_open_is_split_between_the_epoch_rows_that_see_it():
    secret, notes = new_secret(), []
    with _server(secret) as server:
        clients = [PSClient(*server.address, rank=r, secret=secret, timeout_s=20) for r in (0, 1)]
        try:
            for client in clients:
                client.connect()
            watch = _watch(server, notes)
            with watch:
                time.sleep(1.0)  # both silent: neither pushes
                first = watch.epoch_metrics()
                time.sleep(0.5)
                second = watch.epoch_metrics()
            for client in clients:
                client.finish()
        finally:
            for client in clients:
                client.close()
    for rank in (0, 1):
        assert 0.9 <= first[f"rank{rank}/stall_s"] <= 1.5, first
        assert 0.35 <= second[f"rank{rank}/stall_s"] <= 0.8, second  # counted once, not from the start again
