"""ps.server_processes: every shard in a child process of its own, behind the same facade and wire."""
from __future__ import annotations

import functools
import os
import signal
import time

import pytest
import torch

from pipeline.errors import PSError, PSTimeoutError
from pipeline.ps import OptimizerSpec
from pipeline.models.state import merge_buffers
from pipeline.ps.state.buffers import BufferStore

N = 11
SGD = OptimizerSpec(name="sgd", lr=0.1, momentum=0.9)


def _train(server, clients, grads, first_step=0):
    """Sync steps of every client; each rank pushes its own gradient of each step."""
    for step, per_rank in enumerate(grads, start=first_step):
        for client, grad in zip(clients, per_rank):
            client.push(step, grad)
        for client in clients:
            client.pull(step + 1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z"  # a zombie is not alive


def _buffer_store() -> BufferStore:
    # The model's merge rule, over a layout of one fp32 buffer of 3 values (what travels to the child as data)
    return BufferStore(torch.zeros(3), functools.partial(merge_buffers, (("float32", 3),)))


def test_shard_processes_train_exactly_like_shard_threads(make_server, make_client, secret):
    torch.manual_seed(0)
    initial = torch.randn(N)
    grads = [[torch.randn(N) for _ in range(2)] for _ in range(3)]
    metrics: dict[bool, list] = {False: [], True: []}
    results = []
    for processes in (False, True):
        server = make_server(initial, world_size=2, shards=2, optimizer=SGD, server_processes=processes,
                             on_metrics=lambda rank, m, got=metrics[processes]: got.append((rank, m)),
                             buffers=_buffer_store())
        clients = [make_client(server, r) for r in range(2)]
        for c in clients:
            c.connect()
        _train(server, clients, grads)
        clients[1].report({"loss": 0.5})
        assert torch.equal(clients[0].pull_buffers(), torch.zeros(3))  # the attempt's start
        for rank, c in enumerate(clients):
            c.push_buffers(3, torch.full((3,), float(rank + 1)))
        results.append((server.parameters(), server.state_dict(), server.stats, server.buffers()))
    (threads, t_state, t_stats, t_buffers), (procs, p_state, p_stats, p_buffers) = results
    assert torch.equal(t_buffers, p_buffers)
    assert torch.equal(threads, procs)
    assert torch.equal(t_state["optimizer"]["state"][0]["momentum_buffer"],
                       p_state["optimizer"]["state"][0]["momentum_buffer"])
    assert p_state["version"] == 3 and p_stats["steps_applied_by_rank"] == {0: 3, 1: 3}
    pids = [s["pid"] for s in p_stats["by_shard"]]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    deadline = time.monotonic() + 5  # METRICS of the child reach the driver, through the events pipe
    while not metrics[True] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert metrics[True] == [(1, {"loss": 0.5})] == metrics[False]
    # BUFFERS reach the driver's store through shard 0's child, merged by the model's rule (the mean)
    assert torch.equal(p_buffers, torch.full((3,), 1.5)) and torch.equal(p_state["buffers"], p_buffers)
    for pid in pids:  # the secret travelled down a pipe: neither argv nor the environment carries it
        assert secret not in open(f"/proc/{pid}/cmdline", "rb").read()
        assert secret.hex().encode() not in open(f"/proc/{pid}/environ", "rb").read()

    # A rank's failure seen by shard 0's process reaches the waiters of shard 1's, with one verdict.
    clients[0].push(3, grads[0][0])
    clients[1].fail("CUDA error: out of memory", "tail")
    with pytest.raises(PSError, match="rank 1.*out of memory"):
        clients[0].pull(4)
    assert list(server.root_failures) == [1] and server.failures[1].log_tail == "tail"
    assert server.aborted


def test_a_killed_shard_process_fails_fast_naming_it_and_a_checkpoint_revives_it(server_factory, make_client,
                                                                                background, secret):
    torch.manual_seed(1)
    with pytest.raises(RuntimeError, match="the driver failed"):  # children are reaped on a driver error too
        with server_factory(torch.zeros(N), world_size=2, shards=2, optimizer=SGD, server_processes=True,
                            secret=secret, timeout_s=30) as server:  # fails fast: long before a deadline
            pids = _kill_and_revive(server, make_client, background)
            raise RuntimeError("the driver failed")
    assert not any(_alive(pid) for pid in pids)


def _kill_and_revive(server, make_client, background) -> list[int]:
    clients = [make_client(server, r, timeout_s=30) for r in range(2)]
    for c in clients:
        c.connect()
    grads = [[torch.randn(N) for _ in range(2)] for _ in range(4)]
    _train(server, clients, grads[:2])
    checkpoint = server.state_dict()
    victim = server.stats["by_shard"][1]["pid"]
    host, port = server.shards[1].host, server.shards[1].port
    clients[0].push(2, grads[2][0])
    waiting = background(lambda: clients[0].pull(3))
    os.kill(victim, signal.SIGKILL)
    error = waiting.outcome()
    # Released by the death itself, not by the 30 s step deadline (whose error is a PSTimeoutError).
    assert isinstance(error, PSError) and not isinstance(error, PSTimeoutError), repr(error)
    for part in ("parameter server shard 1", f"pid {victim}", f"{host}:{port}", "SIGKILL"):
        assert part in str(error), (part, str(error))
    assert server.aborted
    with pytest.raises(PSError, match=f"shard 1 \\(pid {victim}"):
        server.state_dict()

    server.load_state_dict(checkpoint)  # a fresh child for shard 1, every shard at the checkpoint
    assert not _alive(victim)
    generation = server.new_generation()
    assert server.stats["by_shard"][1]["pid"] != victim
    again = [make_client(server, r, generation=generation) for r in range(2)]
    for c in again:
        c.connect()
    _train(server, again, grads[2:], first_step=2)
    assert server.version == 4
    assert server.stats["steps_applied_by_rank"] == {0: 4, 1: 4}  # step 2 once: the cut push was dropped
    return [s["pid"] for s in server.stats["by_shard"]]
