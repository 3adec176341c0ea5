"""One parameter-server shard on a worker host (``ps.placement: hosts``): the process (``main``), and the
handle its starting task holds (``HostShardProcess``).

Started by the first barrier task on its host (``pipeline.launch.task.host_shard``) as
``python -m pipeline.ps.processes.host_shard``, with its bootstrap (``Bootstrap``: the driver's registry,
the attempt's secret and generation, which host this is) as one JSON line on stdin: never argv or the
environment. It then:

1. opens its two control links to the driver (``control_link``: TLS pinned with ``ps.tls``, the mutual
   handshake) and introduces itself on each;
2. serves the driver's calls exactly as a shard process on the driver's host does (``shard_process.serve``):
   the driver sends the ``ShardInit`` (its slice of the parameters and optimizer state), starts the shard
   on this host's address, announces the layout, loads the state, and finally calls ``ready``;
3. on ``ready``, writes ``READY <host> <port>`` on stdout, which the task waits for before the barrier's
   allGather (no worker connects to a shard that is not set up).

It ends when the driver closes its links (the attempt is over) or when its task's end of stdin closes (the
task, or its Python worker, died): a shard never outlives the attempt that started it.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
from dataclasses import asdict, dataclass
from typing import Callable, Optional

logger = logging.getLogger(__name__)

READY = "READY"


@dataclass(frozen=True)
class Bootstrap:
    """What a host's shard process needs before it can reach the driver (plain values, one JSON line)."""

    registry: tuple[str, int]
    secret_hex: str
    generation: int
    index: int  # this host's place among the attempt's hosts (their first ranks' order)
    hosts: int
    host: str  # this host's address as Spark knows its executor: the shard listens there
    connect_s: float  # the link's deadline and the key that sets it
    connect_key: str
    max_bytes: int  # the largest control message this end accepts (a slice's state)
    tls_fingerprint: Optional[str] = None  # ps.tls: the job certificate the registry must present

    def to_line(self) -> str:
        return json.dumps(asdict(self)) + "\n"

    @classmethod
    def from_line(cls, line: str) -> "Bootstrap":
        values = json.loads(line)
        values["registry"] = tuple(values["registry"])
        return cls(**values)


def _open_links(boot: Bootstrap):
    from pipeline.ps.processes.control_link import CALLS, EVENTS, open_link
    from pipeline.wire.deadline import Timeout

    pinned = None
    if boot.tls_fingerprint is not None:
        from pipeline.wire.tls import PinnedCert

        pinned = PinnedCert(boot.tls_fingerprint)
    links = []
    for channel in (CALLS, EVENTS):
        link = open_link(*boot.registry, bytes.fromhex(boot.secret_hex), host_index=boot.index, channel=channel,
                         generation=boot.generation, timeout=Timeout(boot.connect_s, boot.connect_key),
                         max_bytes=boot.max_bytes, tls=pinned)
        link.send({"index": boot.index, "hosts": boot.hosts, "host": boot.host, "pid": os.getpid()})
        links.append(link)
    return links


def _exit_when_stdin_closes() -> None:
    """The task that started this process holds the other end of stdin: its end closing means the task
    (or its Python worker) is gone, and a shard must not outlive it."""
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except (OSError, ValueError):
        pass
    logger.warning("the barrier task that started this shard is gone; shutting down")
    logging.shutdown()
    os._exit(3)


class HostShardProcess:
    """The starting task's handle on its host's shard process: started with its bootstrap, then
    ``wait_ready`` for its address and ``wait_exit`` at the task's end. A context manager that kills the
    process if it is still running when the task leaves."""

    def __init__(self, boot: Bootstrap, *, python_path: Optional[str] = None) -> None:
        """``python_path``: where the starting process imported ``pipeline`` from, put first on the child's
        path (an executor's Python has it from a shipped wheel, not from site-packages)."""
        import subprocess

        self.boot = boot
        env = dict(os.environ)
        if python_path:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (python_path, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen([sys.executable, "-m", "pipeline.ps.processes.host_shard"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True, env=env)
        self.pid = self._proc.pid
        self.address: Optional[tuple[str, int]] = None
        try:
            self._proc.stdin.write(boot.to_line())  # the secret goes down stdin, never argv or the environment
            self._proc.stdin.flush()
        except OSError as exc:
            self.close()
            from pipeline.errors import PSError

            raise PSError(f"the parameter-server shard process (pid {self.pid}) ended before it read its "
                          f"bootstrap: {exc}") from None

    def wait_ready(self, timeout) -> tuple[str, int]:
        """The shard's address once the driver has set it up; PSTimeoutError naming ``timeout``'s key, or
        PSError with the exit code when the process ended first (the driver refused or set up nothing)."""
        from pipeline.errors import PSError
        from pipeline.wire.deadline import deadline_after, remaining

        deadline = deadline_after(timeout)
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self._proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(remaining(deadline))
        if reader.is_alive():
            raise timeout.error(f"the driver to set up this host's parameter-server shard (pid {self.pid}, host "
                                f"{self.boot.index} of {self.boot.hosts})",
                                why="every host's shard process must reach the driver first")
        words = (line[0] if line else "").split()
        if len(words) != 3 or words[0] != READY:
            if self._proc.poll() is None:  # alive, but it wrote something else on its READY channel
                self.close()
                raise PSError(f"this host's parameter-server shard process (pid {self.pid}) wrote "
                              f"{(line[0] if line else '')[:200]!r} instead of READY")
            raise PSError(f"this host's parameter-server shard process (pid {self.pid}) ended before it was set up "
                          f"(exit code {self._proc.returncode}); the driver's log says why")
        self.address = (words[1], int(words[2]))
        return self.address

    def wait_exit(self, poll_s: float = 0.2, stop: Optional[Callable[[], bool]] = None) -> Optional[int]:
        """Wait until the driver ends the shard (it does once every rank finished or the attempt failed).
        No deadline of its own: the driver closes it on every path where the driver lives, the process ends
        when the driver's links break, and a barrier task the driver gave up on is killed by Spark."""
        import subprocess

        while True:
            try:
                return self._proc.wait(poll_s)
            except subprocess.TimeoutExpired:
                if stop is not None and stop():
                    return None

    def __enter__(self) -> "HostShardProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close stdin (the process's cue that its task is gone), then kill it if it lingers."""
        import subprocess

        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s ps-host-shard[{os.getpid()}] %(levelname)s %(name)s: %(message)s")
    boot = Bootstrap.from_line(sys.stdin.readline())
    from pipeline.ps.processes.shard_process import serve

    def ready(shard) -> None:
        host, port = shard.address
        sys.stdout.write(f"{READY} {host} {port}\n")
        sys.stdout.flush()

    calls, events = _open_links(boot)
    threading.Thread(target=_exit_when_stdin_closes, daemon=True, name="ps-host-shard-stdin").start()
    code = 0
    try:
        serve(calls, calls, events, on_ready=ready, secret=bytes.fromhex(boot.secret_hex))
    except BaseException:  # noqa: BLE001 - e.g. the driver's end broke mid-reply; the driver names the loss
        logger.warning("shard of host %d stopped serving the driver", boot.index, exc_info=True)
        code = 1
    finally:
        for link in (calls, events):
            link.close()
    logging.shutdown()
    os._exit(code)  # as shard_process: skip the interpreter's slow teardown of torch and the connection threads


if __name__ == "__main__":
    from pipeline.ps.processes.host_shard import main as _main  # the package's classes, as shard_process does

    _main()
