"""ps.placement=hosts at the PS level: real host-shard processes (``python -m pipeline.ps.processes.host_shard``)
reach a real registry over the authenticated wire, the SpreadServer attaches them, real clients train.
Every "host" is 127.0.0.1 here; tests/cluster runs it on separate network namespaces."""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import signal

import pytest
import torch

from pipeline.errors import PSError, PSTimeoutError
from pipeline.models.state import merge_buffers
from pipeline.ps import OptimizerSpec, PSClient, PSSettings
from pipeline.ps.modes.consistency import Consistency
from pipeline.ps.processes.host_shard import Bootstrap, HostShardProcess
from pipeline.ps.processes.registry import ShardRegistry
from pipeline.ps.server.spread import SpreadServer
from pipeline.ps.state.buffers import BufferStore
from pipeline.wire.deadline import CONNECT_KEY, STEP_KEY, Timeout

HOST = "127.0.0.1"
N = 13
SGD = OptimizerSpec(name="sgd", lr=0.1, momentum=0.9)
CONNECT = Timeout(20.0, CONNECT_KEY)  # a fresh Python importing torch per host process


def _settings(mode: str = "sync", step_s: float = 10.0) -> PSSettings:
    return PSSettings(optimizer=SGD, consistency=Consistency(mode=mode), step_timeout=Timeout(step_s, STEP_KEY),
                      server_threads=1)


def _buffers() -> BufferStore:
    return BufferStore(torch.zeros(3), functools.partial(merge_buffers, (("float32", 3),)))


class Hosts:
    """A registry and ``count`` host-shard processes for one generation (closed by the test's end)."""

    def __init__(self, secret: bytes, count: int, generation: int = 1) -> None:
        self.registry = ShardRegistry(HOST, secret, generation, max_bytes=1 << 24)
        self.processes = [HostShardProcess(Bootstrap(
            registry=self.registry.address, secret_hex=secret.hex(), generation=generation, index=i, hosts=count,
            host=HOST, connect_s=CONNECT.seconds, connect_key=CONNECT.key, max_bytes=1 << 24)) for i in range(count)]

    def attach(self, server: SpreadServer, generation: int = 1) -> None:
        server.attach(self.registry.wait_for_hosts(CONNECT), generation)
        for p in self.processes:
            p.wait_ready(CONNECT)

    def close(self) -> None:
        self.registry.close()
        for p in self.processes:
            p.close()


@pytest.fixture
def hosts(secret):
    made: list[Hosts] = []

    def make(count: int, generation: int = 1) -> Hosts:
        made.append(Hosts(secret, count, generation))
        return made[-1]

    yield make
    for h in made:
        h.close()


def _train(address, secret, grads, generation=1, first_step=0, *, one_by_one=False):
    """Two ranks' steps, then their buffers and FINISH. Sync order (every push of a step, then the pulls), or
    ``one_by_one`` (each rank's push answered before the other's: one arrival order for async and ssp)."""
    clients = [PSClient(*address, rank=r, secret=secret, generation=generation, timeout_s=10.0) for r in range(2)]
    try:
        for c in clients:
            c.connect()
        for step, per_rank in enumerate(grads, start=first_step):
            for client, grad in zip(clients, per_rank):
                client.push(step, grad)
                if one_by_one:
                    client.pull(step + 1)
            for client in [] if one_by_one else clients:
                client.pull(step + 1)
        for rank, c in enumerate(clients):
            c.push_buffers(first_step + len(grads), torch.full((3,), float(rank + 1)))
        for c in clients:
            c.finish()
    finally:
        for c in clients:
            c.close()


def test_shards_on_two_hosts_train_bit_for_bit_like_the_driver_server(hosts, make_server, secret):
    torch.manual_seed(0)
    initial = torch.randn(N)
    grads = [[torch.randn(N) for _ in range(2)] for _ in range(4)]
    reference = make_server(initial, world_size=2, shards=1, optimizer=SGD, timeout_s=10.0, buffers=_buffers())
    _train(reference.address, secret, grads)

    metrics: list = []
    spread = SpreadServer(initial, _settings(), world_size=2, secret=secret, buffers=_buffers(),
                          on_metrics=lambda rank, m: metrics.append(rank))
    bed = hosts(2)
    bed.attach(spread)
    layout = spread.shards
    assert [(a.start, a.end) for a in layout] == [(0, 7), (7, 13)]
    assert {a.port for a in layout} == {p.address[1] for p in bed.processes}  # each process serves its slice
    _train(spread.address, secret, grads)
    assert spread.finished_ranks == {0, 1}
    assert spread.detach()
    assert not spread.attached
    # fp32 sums of two ranks and an elementwise optimizer: the same bits as one driver-hosted shard
    assert torch.equal(spread.parameters(), reference.parameters())
    assert spread.version == 4
    assert torch.equal(spread.buffers(), torch.full((3,), 1.5))  # the replicas' buffers, merged on the driver
    for p in bed.processes:  # detaching closed the shards: their processes end by themselves
        assert p.wait_exit() == 0


ADAM = OptimizerSpec(name="adam", lr=0.01)


@pytest.mark.parametrize("mode, compression, staleness, optimizer", [
    ("sync", "fp16", 0, SGD), ("sync", "topk", 0, SGD), ("async", "none", 0, ADAM), ("ssp", "bf16", 1, SGD),
    ("average", "none", 0, SGD)])
def test_every_mode_and_compression_on_two_hosts_matches_two_driver_shards(hosts, make_server, secret, mode,
                                                                           compression, staleness, optimizer):
    """The same slices, the same elementwise updates, the same arrival order (one thread drives both ranks):
    shards on two hosts and two shards beside the driver end on the same bits."""
    torch.manual_seed(2)
    initial = torch.randn(N)
    grads = [[torch.randn(N) for _ in range(2)] for _ in range(5)]
    consistency = Consistency(mode=mode, staleness=staleness)
    reference = make_server(initial, world_size=2, shards=2, optimizer=optimizer, timeout_s=10.0,
                            buffers=_buffers(), consistency=consistency, compression=compression, topk_ratio=0.3)
    _train_mode(reference.address, secret, grads, mode)
    settings = dataclasses.replace(_settings(mode), consistency=consistency, compression=compression, topk_ratio=0.3,
                                   optimizer=optimizer)
    spread = SpreadServer(initial, settings, world_size=2, secret=secret, buffers=_buffers())
    hosts(2).attach(spread)
    _train_mode(spread.address, secret, grads, mode)
    assert spread.detach()
    assert torch.equal(spread.parameters(), reference.parameters())
    assert spread.version == reference.version


def _train_mode(address, secret, grads, mode):
    _train(address, secret, grads, one_by_one=mode in ("async", "ssp"))


def test_a_retry_attaches_other_hosts_and_continues_from_the_kept_state(hosts, make_server, secret):
    torch.manual_seed(1)
    initial = torch.randn(N)
    grads = [[torch.randn(N) for _ in range(2)] for _ in range(4)]
    reference = make_server(initial, world_size=2, shards=1, optimizer=SGD, timeout_s=10.0, buffers=_buffers())
    _train(reference.address, secret, grads)

    spread = SpreadServer(initial, _settings(), world_size=2, secret=secret, buffers=_buffers())
    first = hosts(2)
    first.attach(spread)
    _train(spread.address, secret, grads[:2])
    assert spread.detach()
    assert spread.new_generation() == 2
    second = hosts(3, generation=2)  # the next attempt lands on three hosts: the slices are re-spread
    second.attach(spread, generation=2)
    assert len(spread.shards) == 3
    _train(spread.address, secret, grads[2:], generation=2, first_step=2)
    assert spread.detach()
    assert torch.equal(spread.parameters(), reference.parameters())  # momentum carried across the re-spread


def test_a_killed_host_shard_fails_the_attempt_naming_it_and_leaves_no_state(hosts, secret):
    spread = SpreadServer(torch.zeros(N), _settings(), world_size=2, secret=secret)
    bed = hosts(2)
    bed.attach(spread)
    client = PSClient(*spread.address, rank=0, secret=secret, generation=1, timeout_s=10.0)
    try:
        client.connect()
        client.push(0, torch.ones(N))
        victim = bed.processes[1].pid
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(PSError, match=f"shard 1 \\(host 1 {HOST}, pid {victim}.*control link") as caught:
            client.pull(1)
        assert not isinstance(caught.value, PSTimeoutError)  # released by the death, not the step deadline
    finally:
        client.close()
    assert spread.aborted and f"pid {victim}" in spread.failure_cause
    assert not spread.detach()
    assert spread.aborted  # still, detached: the stage watchdog's grace must end the failed attempt's job
    spread.new_generation()
    assert not spread.aborted  # the next attempt starts clean
    with pytest.raises(PSError, match="no consistent state"):
        spread.state_dict()


def test_a_host_shard_that_stops_answering_is_lost_after_the_step_deadline(hosts, secret):
    """A cut-off host sends no FIN: the driver's call it does not answer within timeouts.step_s is its loss."""
    spread = SpreadServer(torch.zeros(N), _settings(step_s=1.5), world_size=2, secret=secret)
    bed = hosts(2)
    bed.attach(spread)
    frozen = bed.processes[1].pid
    os.kill(frozen, signal.SIGSTOP)  # as a cut link looks to the driver: nothing comes back, nothing closes
    try:
        assert spread.aborted  # asking shard 1 ran into the deadline: its loss, named once, failing every waiter
    finally:
        os.kill(frozen, signal.SIGCONT)
    assert re.search(rf"shard 1 \(host 1 {HOST}, pid {frozen}, .*\) did not answer the driver's \w+ within 1.5s "
                     r"\(timeouts.step_s\): its host is cut off, or the process hangs", spread.failure_cause)
    assert not spread.detach()
    assert bed.processes[1].wait_exit() is not None  # its links closed: the process ended


def test_hosts_that_disagree_or_never_come_are_named(secret):
    registry = ShardRegistry(HOST, secret, 1, max_bytes=1 << 20)
    try:
        with pytest.raises(PSTimeoutError, match=r"host\(s\) every host.*raise timeouts.connect_s"):
            registry.wait_for_hosts(Timeout(0.3, CONNECT_KEY))
    finally:
        registry.close()


def test_a_process_without_the_secret_is_refused(secret, hosts):
    from pipeline.ps import new_secret

    registry = ShardRegistry(HOST, secret, 1, max_bytes=1 << 20)
    intruder = HostShardProcess(Bootstrap(registry=registry.address, secret_hex=new_secret().hex(), generation=1,
                                          index=0, hosts=1, host=HOST, connect_s=10.0, connect_key=CONNECT_KEY,
                                          max_bytes=1 << 20))
    try:
        assert intruder.wait_exit() != 0  # it could not authenticate
        with pytest.raises(PSTimeoutError, match="every host"):
            registry.wait_for_hosts(Timeout(0.3, CONNECT_KEY))
    finally:
        intruder.close()
        registry.close()


def test_the_secret_is_proved_on_a_control_link_never_sent(hosts, secret, monkeypatch):
    """Without ps.tls the control links are plain TCP: the ShardInit the driver sends carries no secret; the
    host's process uses its own copy (from its task's stdin) to authenticate the workers."""
    from pipeline.ps.processes import control_link
    from pipeline.ps.processes.codec import encode

    sent: list[bytes] = []
    real = control_link.Link.send

    def spy(self, obj):
        sent.append(b"".join(bytes(frame) for frame in encode(obj)))
        return real(self, obj)

    monkeypatch.setattr(control_link.Link, "send", spy)
    spread = SpreadServer(torch.zeros(N), _settings(), world_size=2, secret=secret, buffers=_buffers())
    hosts(2).attach(spread)
    _train(spread.address, secret, [[torch.ones(N), torch.ones(N)]])  # the shards still admit the ranks
    assert spread.detach() and spread.version == 1
    assert len(sent) > 4 and not any(secret in blob or secret.hex().encode() in blob for blob in sent)


def test_sparse_tables_spread_over_two_hosts_train_like_the_driver_store_and_move_to_three(hosts, secret):
    """Each host's shard keeps the rows hashed to it; two ranks training the two-table model end on the
    rows and dense parameters of the driver's single store, and the rows survive a re-spread to 3 hosts."""
    from pipeline.models import flat_parameters
    from pipeline.models.sparse_embedding import sparse_modules
    from pipeline.ps.sparse.rowopt import RowOptimizerSpec
    from pipeline.ps.sparse.spec import SparseSpec

    from tests.pipeline.ps.sparse.helpers import TwoTables, make_server, run_ranks, train_rank

    def model():
        torch.manual_seed(0)
        return TwoTables()

    row_opt = RowOptimizerSpec("adagrad", lr=0.2)
    reference = make_server(model(), secret, world_size=2, row_opt=row_opt, timeout_s=10.0)
    run_ranks(2, lambda rank: train_rank(reference, secret, rank, 6, model))
    spec = SparseSpec(tuple(m.spec for m in sparse_modules(model())), row_opt, row_shards=2)
    settings = dataclasses.replace(_settings(), optimizer=OptimizerSpec(name="sgd", lr=0.1))
    spread = SpreadServer(flat_parameters(model()), settings, world_size=2, secret=secret, sparse=spec)
    hosts(2).attach(spread)
    run_ranks(2, lambda rank: train_rank(spread, secret, rank, 3, model))
    by_shard = spread.stats["by_shard"]
    assert all(s["sparse"]["rows_pushed"] > 0 for s in by_shard)  # both hosts served rows
    assert spread.stats["sparse"]["pushes"] == sum(s["sparse"]["pushes"] for s in by_shard)
    assert spread.detach()
    spread.new_generation()
    hosts(3, generation=2).attach(spread, generation=2)
    run_ranks(2, lambda rank: train_rank(spread, secret, rank, 6, model, generation=2))
    assert spread.detach()

    assert torch.equal(spread.parameters(), reference.parameters())
    want, got = reference.state_dict()["sparse"], spread.state_dict()["sparse"]
    for name in ("a", "b"):
        ids = [torch.cat([s["ids"] for s in t[name]["shards"]]) for t in (want, got)]
        rows = [torch.cat([s["rows"] for s in t[name]["shards"]]) for t in (want, got)]
        order = [torch.argsort(i) for i in ids]
        assert torch.equal(ids[0][order[0]], ids[1][order[1]])
        assert torch.equal(rows[0][order[0]], rows[1][order[1]])
    assert len(got["a"]["shards"]) == 3 * 2  # three hosts' parts of two row shards each, side by side
    reference.close()


def test_each_host_shard_writes_its_checkpoint_part_and_the_set_loads_as_the_state(hosts, secret, tmp_path):
    """Checkpoints as sets: every host's process writes its slice itself, the driver commits the record
    naming the parts and their digests, and the set loads as the state the driver would have pulled."""
    from pipeline.checkpoints import CheckpointStore
    from pipeline.ps.state.sharded import merge_checkpoint_parts

    torch.manual_seed(3)
    initial = torch.randn(N)
    spread = SpreadServer(initial, _settings(), world_size=2, secret=secret, buffers=_buffers())
    hosts(2).attach(spread)
    _train(spread.address, secret, [[torch.randn(N) for _ in range(2)] for _ in range(3)])
    store = CheckpointStore(str(tmp_path / "ckpt"), merge_parts=merge_checkpoint_parts)
    record = spread.write_parts(store.parts_directory, "tok", timeout_s=20.0)
    assert [p["file"] for p in record["parts"]] == ["tok-shard-0-of-2.pt", "tok-shard-1-of-2.pt"]
    assert "params" not in record and record["version"] == 3  # no parameter bytes came to the driver
    info = store.save({"step": record["version"], "ps": record})
    loaded, direct = store.load(info)["ps"], spread.state_dict()
    assert torch.equal(loaded["params"], direct["params"])
    momentum = [s["optimizer"]["state"][0]["momentum_buffer"] for s in (loaded, direct)]
    assert torch.equal(*momentum)
    assert torch.equal(loaded["buffers"], direct["buffers"]) and loaded["version"] == direct["version"]
    assert spread.detach()
