"""One parameter-server shard in a process of its own (``ps.server_processes``): the child side.

Run as ``python -m pipeline.ps.processes.shard_process --requests FD --replies FD --events FD`` by
``pipeline.ps.processes.shard_proxy.ShardProcess`` (never forked from the driver: a driver holds a JVM and
Spark's threads). The three file descriptors are pipes to the parent only:

* requests (parent -> child) / replies (child -> parent): one typed call at a time, answered in order;
  the first message is the ``ShardInit`` (the initial slice, the settings, the job secret: the secret
  never appears in argv or in the environment);
* events (child -> parent): what the shard's connection threads tell the driver unasked, a rank's
  failure (the parent's ``FailureBoard`` decides the verdict and mirrors it to every shard) and METRICS.

The messages are data only (``control_pipe``: tagged JSON plus raw tensor bytes, objects rebuilt only
as a fixed set of dataclasses); the network side of the child is the unchanged shard (same wire,
handshake, deadlines and refusals). The parent's end closing (the driver exited or was killed) closes
the shard and ends the process, so a child never outlives its driver.

What the child hosts is generic: ``HOSTED`` maps a kind to a builder of "a shard's state" plus the
calls the parent may make on it, so another shard kind (plain state + ``state_dict``) can be hosted the
same way; today the only kind is ``dense`` (``shard.ShardServer``).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from pipeline.ps.processes.shard_init import ShardInit

logger = logging.getLogger(__name__)


# Read-only views the parent may ask for (``get``), and the calls it may make (``call``).
DENSE_VIEWS = frozenset({"address", "version", "generation", "aborted", "registered_ranks", "finished_ranks",
                         "failures", "root_failures", "waiting_ranks", "stats"})
DENSE_CALLS = frozenset({"start", "close", "fail", "new_generation", "set_layout", "mark_failure", "state_dict",
                         "load_state_dict", "parameters"})
BUFFER_CALLS = frozenset({"set_base"})


class _Events:
    """The events pipe, written by any connection thread (one message at a time)."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, *message: Any) -> None:
        with self._lock:
            try:
                self._conn.send(message)
            except OSError:  # the parent is gone: the requests pipe's EOF ends this process
                pass


def _build_dense(init: ShardInit, events: _Events, buffers: Any) -> Any:
    from pipeline.errors import WorkerFailure
    from pipeline.ps.server.shard import ShardServer

    def sink(failure: WorkerFailure, consequence: bool, generation: int) -> None:
        events.send("failure", failure.rank, failure.error, failure.log_tail, failure.retryable, consequence,
                    generation)

    def metrics(rank: int, values: dict) -> None:
        events.send("metrics", rank, values)

    sparse = None
    if init.sparse is not None:  # this shard's part of every sparse table (its rows, hashed by id)
        sparse = init.sparse.build(init.settings.consistency, init.world_size,
                                   part=(init.shard_index, init.sparse_parts))
    return ShardServer(init.initial, init.settings, world_size=init.world_size, secret=init.secret, host=init.host,
                       port=init.port, generation=init.generation, shard_index=init.shard_index, start=init.start,
                       total_params=init.total_params, buffers=buffers, tls=init.tls,
                       failure_sink=sink if init.report_failures else None,
                       on_metrics=metrics if init.forward_metrics else None, sparse=sparse)


@dataclass(frozen=True)
class Hosted:
    build: Callable[[ShardInit, _Events, Any], Any]
    views: frozenset
    calls: frozenset


HOSTED: dict[str, Hosted] = {"dense": Hosted(_build_dense, DENSE_VIEWS, DENSE_CALLS)}


def _handle(hosted: Hosted, shard: Any, buffers: Any, op: str, args: tuple) -> Any:
    if op == "get" and args and args[0] in hosted.views:
        return getattr(shard, args[0])
    if op == "call" and args and args[0] in hosted.calls:
        result = getattr(shard, args[0])(*args[1:])
        return None if result is shard else result  # start() returns the shard itself
    if op == "buffers" and buffers is not None and args and args[0] in BUFFER_CALLS:
        return getattr(buffers, args[0])(*args[1:])
    if op == "buffers" and buffers is not None and args == ("forwarded",):
        return buffers.forwarded
    if op == "write_part" and len(args) == 2 and all(isinstance(a, str) for a in args):
        from pipeline.ps.state.part_file import write_part  # a checkpoint set's part, written by this shard

        return write_part(shard.state_dict(), *args)
    if op == "cpu":  # this process's CPU seconds (user + system, every thread): the bench's per-update cost
        return time.process_time()
    raise ValueError(f"the shard process does not answer {op!r} {args[:1]!r}")


def serve(requests: Any, replies: Any, events_conn: Any, *, on_ready: Callable[[Any], None] | None = None,
          secret: bytes | None = None) -> None:
    """Build the shard from the first message, then answer calls until the parent's end closes.
    ``on_ready(shard)`` answers the parent's ``ready`` (ps.placement=hosts: the shard is set up, tell the task);
    ``secret``: the job secret this process got on its own (ps.placement=hosts: the ShardInit that crosses the
    network carries none, so the secret is only ever proved on the wire, never sent)."""
    init = requests.recv()
    if not isinstance(init, ShardInit) or init.kind not in HOSTED:
        raise SystemExit(f"shard process: the first message must be a ShardInit of a known kind, got "
                         f"{type(init).__name__} {getattr(init, 'kind', '')!r}")  # never its repr: the secret
    if secret is not None:
        init = dataclasses.replace(init, secret=secret)
    hosted = HOSTED[init.kind]
    events = _Events(events_conn)
    buffers = None
    if init.buffers is not None:
        from pipeline.ps.state.buffers import BufferMirror

        buffers = BufferMirror(init.buffers, lambda rank, words: events.send("buffers", rank, words))
    shard = hosted.build(init, events, buffers)
    try:
        while True:
            try:
                op, args = requests.recv()
            except EOFError:  # the parent closed its end, or died: nothing may keep serving
                logger.info("parameter server shard %s: the driver's end closed, shutting down", init.shard_index)
                return
            try:
                if op == "ready" and on_ready is not None:
                    replies.send(("ok", on_ready(shard)))
                    continue
                replies.send(("ok", _handle(hosted, shard, buffers, op, args)))
            except Exception as exc:  # the parent re-raises it as a PSError naming this shard
                replies.send(("error", f"{type(exc).__name__}: {exc}"))
            if op == "call" and args[0] == "close":
                return
    finally:
        shard.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one parameter-server shard (started by the driver)")
    for name in ("--requests", "--replies", "--events"):
        parser.add_argument(name, type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s ps-shard-process[{os.getpid()}] %(levelname)s %(name)s: %(message)s")
    from pipeline.ps.processes.control_pipe import Pipe

    serve(Pipe(args.requests, readable=True), Pipe(args.replies, readable=False),
          Pipe(args.events, readable=False))
    # The shard is closed (sockets shut, threads told): skip the interpreter's slow teardown of torch and
    # of the connection threads' joins, so the driver reaps K children in milliseconds, not seconds.
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    # Through the package module, so the ShardInit the parent sent is the class this child checks.
    from pipeline.ps.processes.shard_process import main as _main

    _main()
