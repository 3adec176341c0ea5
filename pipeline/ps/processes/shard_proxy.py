"""One parameter-server shard in a child process (``ps.server_processes``): the driver's side.

``ShardProcess`` has the surface of ``shard.ShardServer`` that the facade (``server.ParameterServer``),
``fanout.ServerGroup`` and ``failures.FailureBoard`` use, and forwards each call to the child
(``pipeline.ps.processes.shard_process``) over its private pipes. Workers never talk to this object: they talk to
the child's listener, on the same host address, with the same secret, wire and deadlines.

Why a child process: the shards of one process share one GIL, so K shards did not serve more updates
per second than one (bench/ps_bench.py); in processes of their own they use K cores.

A child that dies (killed, out of memory, a crash) is noticed by the events pipe closing: ``on_death``
gets one text naming the shard (index, pid, address, exit code or signal) and the facade fails the
attempt with it at once. Views of a dead shard answer their last known value (the progress bar and the
checkpointer poll them); calls that need its state raise ``PSError`` with that text, so the launcher's
retry restores the newest checkpoint into a fresh child (``ParameterServer.revive``).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from typing import Any, Callable

from pipeline.errors import PSError, ProtocolError, WorkerFailure
from pipeline.ps.transport.connection import ShardAddress
from pipeline.ps.modes.consistency import Consistency
from pipeline.ps.processes.control_pipe import Pipe
from pipeline.ps.processes.shard_init import ShardInit

logger = logging.getLogger(__name__)

# Generous: a call's own waits are bounded by the shard (close's grace, a snapshot under its lock); this
# only catches a child that stopped answering altogether. Starting also imports torch in the child.
CALL_TIMEOUT_S = 60.0
START_TIMEOUT_S = 120.0
_REAP_S = 5.0
SERVER_PROCESSES_KEY = "ps.server_processes"


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running but not answering"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"killed by signal {-code} (exit code {code})"
    return f"exit code {code}"


class ShardProxy:
    """The driver's side of one shard that runs in another process, over its three channels (requests,
    replies, events: pipes to a child, or the control links of a shard on a worker host). Subclasses say
    how the process is reached and how its end is told: ``_exit_text``, ``_gone``, ``_reap``, ``_where``."""

    def __init__(self, init: ShardInit, channels: tuple[Any, Any, Any], *, pid: int,
                 failure_sink: Callable[[WorkerFailure, bool, int], None] | None,
                 on_metrics: Callable[[int, dict], None] | None, on_death: Callable[[str], None],
                 on_buffers: Callable[[int, Any], None] | None = None) -> None:
        self._index, self._start, self._num_params = init.shard_index, init.start, init.initial.numel()
        self._consistency: Consistency = init.settings.consistency
        self._failure_sink, self._on_metrics, self._on_death = failure_sink, on_metrics, on_death
        self._on_buffers = on_buffers
        self._lock = threading.Lock()  # one call at a time: replies come back in order
        self._closing = False
        self._death: str | None = None
        self._last: dict[str, Any] = {"version": 0, "generation": init.generation, "aborted": True,
                                      "registered_ranks": set(), "finished_ranks": set(), "failures": {},
                                      "root_failures": {}, "waiting_ranks": {}, "stats": {}}
        self.address_or_none: tuple[str, int] | None = None
        self._requests, self._replies, self._events = channels
        self.pid = pid
        self._call_timeout_s = CALL_TIMEOUT_S
        self._reader = threading.Thread(target=self._read_events, daemon=True, name=f"ps-shard-{self._index}-events")
        self._reader.start()
        try:
            with self._lock:
                self._requests.send(init)  # the secret goes down the channel, never argv or the environment
        except OSError:
            pass  # the process died at once; the reader reports it and start() raises

    # -- how the process is reached (subclasses) -------------------------------------------------------
    def _exit_text(self) -> str:
        raise NotImplementedError

    def _gone(self) -> bool:
        raise NotImplementedError

    def _reap(self) -> None:
        raise NotImplementedError

    def _where(self) -> str:
        return f"pid {self.pid}"

    def _unanswered(self, what: str, timeout: float) -> PSError:
        """The error of a call the process did not answer in time (called holding the call lock)."""
        return PSError(f"{self.describe()} did not answer {what} within {timeout:g}s")

    # -- the pipes -----------------------------------------------------------------------------------
    def _call(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        timeout = self._call_timeout_s if timeout is None else timeout
        with self._lock:
            if self._death is not None:
                raise PSError(self._death)
            try:
                self._requests.send((op, args))
                if not self._replies.poll(timeout):
                    raise self._unanswered(str(args[0]) if op in ("get", "call") and args else op, timeout)
                status, value = self._replies.recv()
            except (EOFError, OSError, ProtocolError, ValueError):
                # A broken channel, or a reply it cannot read (the next one would be misread after it): the
                # process is lost to this proxy. While closing, that is just the end (a view racing close()).
                if self._closing:
                    raise PSError(f"{self.describe()} is closed") from None
                raise PSError(self._died()) from None
        if status != "ok":
            raise PSError(f"{self.describe()}: {value}")
        return value

    def _read_events(self) -> None:
        while True:
            try:
                message = self._events.recv()
            except (EOFError, OSError):
                break
            except Exception:  # noqa: BLE001 - an unreadable event: the channel cannot be trusted any more
                logger.exception("%s: unreadable event", self.describe())
                break
            try:
                self._dispatch(message)
            except Exception:  # a callback must not stop the reader that notices the child's death
                logger.exception("%s: handling %s failed", self.describe(), message[0])
        if not self._closing:
            self._on_death(self._died())

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "failure" and self._failure_sink is not None:
            rank, error, log_tail, retryable, consequence, generation = message[1:]
            self._failure_sink(WorkerFailure(rank, error, log_tail, retryable), consequence, generation)
        elif kind == "buffers" and self._on_buffers is not None:
            self._on_buffers(message[1], message[2])
        elif kind == "metrics" and self._on_metrics is not None:
            try:
                self._on_metrics(message[1], message[2])
            except Exception:  # a tracking hiccup must never break training
                logger.exception("on_metrics callback failed for rank %s", message[1])

    def _died(self) -> str:
        if self._death is None:
            self._death = f"{self.describe()} died: {self._exit_text()}"
            logger.error("%s", self._death)
        return self._death

    def describe(self) -> str:
        where = "%s:%s" % self.address_or_none if self.address_or_none else "not listening yet"
        return (f"parameter server shard {self._index} ({self._where()}, {where}, params "
                f"[{self._start}, {self._start + self._num_params}))")

    @property
    def dead(self) -> bool:
        return self._death is not None or self._gone()

    def _view(self, name: str) -> Any:
        if self._death is None:
            try:
                self._last[name] = self._call("get", name)
            except PSError:
                pass
        return self._last[name]

    # -- ShardServer's surface -----------------------------------------------------------------------
    def start(self) -> ShardProxy:
        self.address_or_none = tuple(self._call("call", "start", timeout=START_TIMEOUT_S) or
                                     self._call("get", "address"))
        logger.info("%s started", self.describe())
        return self

    def close(self) -> None:
        """Close the shard and reap the child (killed if it does not exit in time). Idempotent."""
        if self._closing:
            return
        self._closing = True
        try:
            self._call("call", "close", timeout=_REAP_S + 5)
        except PSError:
            pass  # dead or hung: reaped below either way
        for conn in {id(c): c for c in (self._requests, self._replies)}.values():
            conn.close()
        self._reap()
        self._reader.join(_REAP_S)
        self._events.close()

    def fail(self, reason: str) -> None:
        if not self.dead:
            try:
                self._call("call", "fail", reason)
            except PSError:
                pass  # it died meanwhile: its own death fails the attempt

    def new_generation(self, generation: int | None = None) -> int:
        new = self._call("call", "new_generation", generation)
        self._last["generation"] = new
        return new

    def set_layout(self, layout: list[ShardAddress]) -> None:
        self._call("call", "set_layout", layout)

    def mark_failure(self, failure: WorkerFailure, consequence: bool, generation: int) -> bool:
        try:
            return bool(self._call("call", "mark_failure", failure, consequence, generation))
        except PSError:
            return False

    def state_dict(self) -> dict[str, Any]:
        return self._call("call", "state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("call", "load_state_dict", state)

    def write_part(self, directory: str, name: str, timeout: float | None = None) -> dict[str, Any]:
        """The process writes its state as a checkpoint part itself (``pipeline.ps.state.part_file``)."""
        return self._call("write_part", directory, name, timeout=timeout)

    def parameters(self) -> Any:
        return self._call("call", "parameters")

    def buffers_call(self, name: str, *args: Any) -> Any:
        return self._call("buffers", name, *args)

    def cpu_seconds(self) -> float:
        return float(self._call("cpu"))

    @property
    def address(self) -> tuple[str, int]:
        if self.address_or_none is None:
            raise PSError("the parameter server is not started")
        return self.address_or_none

    @property
    def num_params(self) -> int:
        return self._num_params

    @property
    def consistency(self) -> Consistency:
        return self._consistency

    @property
    def version(self) -> int:
        return self._view("version")

    @property
    def generation(self) -> int:
        return self._view("generation")

    @property
    def aborted(self) -> bool:
        return True if self.dead else self._view("aborted")

    @property
    def registered_ranks(self) -> set[int]:
        return self._view("registered_ranks")

    @property
    def finished_ranks(self) -> set[int]:
        return self._view("finished_ranks")

    @property
    def failures(self) -> dict[int, WorkerFailure]:
        return self._view("failures")

    @property
    def root_failures(self) -> dict[int, WorkerFailure]:
        return self._view("root_failures")

    @property
    def waiting_ranks(self) -> dict[int, int]:
        return self._view("waiting_ranks")

    @property
    def stats(self) -> dict[str, Any]:
        stats = dict(self._view("stats"))
        stats["pid"] = self.pid
        return stats


class ShardProcess(ShardProxy):
    """Parent side of one shard process on this host (see module docstring). Spawned at construction, so
    the K children of a server import torch at the same time; ``start()`` binds and returns the address."""

    def __init__(self, init: ShardInit, **callbacks: Any) -> None:
        pipes = [os.pipe() for _ in range(3)]  # requests, replies, events; not inheritable but for pass_fds
        (req_r, req_w), (rep_r, rep_w), (ev_r, ev_w) = pipes
        child_fds = (req_r, rep_w, ev_w)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline.ps.processes.shard_process", "--requests", str(req_r), "--replies",
                 str(rep_w), "--events", str(ev_w)], pass_fds=child_fds, stdin=subprocess.DEVNULL,
                stdout=sys.stderr.fileno() if _has_fileno(sys.stderr) else None)
        except BaseException:
            for fd in (fd for pair in pipes for fd in pair):
                os.close(fd)
            raise
        for fd in child_fds:  # only the child holds these now: its death closes the pipes
            os.close(fd)
        channels = (Pipe(req_w, readable=False), Pipe(rep_r, readable=True), Pipe(ev_r, readable=True))
        super().__init__(init, channels, pid=self._proc.pid, **callbacks)

    def _exit_text(self) -> str:
        try:
            code = self._proc.wait(_REAP_S)
        except subprocess.TimeoutExpired:
            code = None
        return _exit_text(code)

    def _gone(self) -> bool:
        return self._proc.poll() is not None

    def _reap(self) -> None:
        try:
            self._proc.wait(_REAP_S)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not exit; killing it", self.describe())
            self._proc.kill()
            self._proc.wait()


class BuffersInChild:
    """The facade's buffer store with ps.server_processes: the driver's own ``BufferStore`` (the model's
    merge rule stays here), fed by shard 0's child, whose mirror answers PULL_BUFFERS from the base set
    here (at the start, after ``fold`` and ``restore``)."""

    _SYNC_S = 10.0

    def __init__(self, store: Any, shard: Callable[[], ShardProxy]) -> None:
        self._store = store
        self._shard = shard  # the current shard 0 (a revived child replaces the dead one)
        self._received = 0
        self._cond = threading.Condition()
        self.words = store.words

    def report(self, rank: int, words: Any) -> None:
        """A rank's BUFFERS, forwarded by the child (the events reader's thread)."""
        self._store.report(rank, words)
        with self._cond:
            self._received += 1
            self._cond.notify_all()

    def _sync(self) -> None:
        """Wait until every report the child acknowledged to a worker is in the store."""
        try:
            forwarded = self._shard().buffers_call("forwarded")
        except PSError:
            return  # a dead child: what it forwarded before dying is all there is
        with self._cond:
            self._cond.wait_for(lambda: self._received >= forwarded, self._SYNC_S)

    def merged(self) -> Any:
        self._sync()
        return self._store.merged()

    def fold(self) -> None:
        self._sync()
        self._store.fold()
        self._push_base()

    def restore(self, words: Any) -> None:
        self._store.restore(words)
        self._push_base()

    def _push_base(self) -> None:
        self._shard().buffers_call("set_base", self._store.start())
        with self._cond:
            self._received = 0  # a new child or a folded store: counts start again with the child's


def _has_fileno(stream: Any) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):  # pytest's capture, a notebook: inherit ours instead
        return False
    return True
