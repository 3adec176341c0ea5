"""One parameter-server shard in a process on a worker host (``ps.placement: hosts``): the driver's side.

The same proxy as a shard process on the driver's host (``shard_proxy.ShardProxy``: the facade, fan-out
and failure board see the surface of a ``ShardServer``), reached over the two authenticated control links
the process opened to the driver's registry instead of pipes. The driver cannot reap a process on
another machine: the process ends itself when its links close (``host_shard``), and a link that breaks
is the shard's death, named with its host.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from pipeline.errors import PSError

from pipeline.ps.processes.registry import HostChild
from pipeline.ps.processes.shard_init import ShardInit
from pipeline.ps.processes.shard_proxy import ShardProxy

logger = logging.getLogger(__name__)


class RemoteShard(ShardProxy):
    """The driver's proxy of the shard process ``child`` (its links are this object's from now on)."""

    def __init__(self, init: ShardInit, child: HostChild, **callbacks: Any) -> None:
        self._child = child
        # A host cut off sends no FIN: a call it does not answer within the step deadline is its loss, the
        # same deadline a rank's silence gets (and a shorter cut is ridden out). The same bound holds every
        # send and every read inside a reply, so a link cut mid-message cannot hold a call forever.
        self._step = init.settings.step_timeout
        child.calls.set_io_timeout(self._step.seconds)
        # The secret is proved on the wire, never sent: the process has its own copy from its task's stdin.
        super().__init__(dataclasses.replace(init, secret=b""), (child.calls, child.calls, child.events),
                         pid=child.pid, **callbacks)
        self._call_timeout_s = self._step.seconds

    @property
    def host_index(self) -> int:
        return self._child.index

    def ready(self) -> None:
        """The shard is set up (started, layout announced, state loaded): its process tells its task."""
        self._call("ready")

    def _where(self) -> str:
        return f"host {self._child.index} {self._child.host}, pid {self.pid}"

    def _unanswered(self, what: str, timeout: float) -> PSError:
        """The link may now carry a late reply out of order: the shard is lost, named once, and its links
        closed (which ends the process if it still runs). Not while closing: the end of the attempt."""
        if self._closing:
            return PSError(f"{self.describe()} did not answer {what} within {timeout:g}s while closing")
        if self._death is None:
            knob = f" ({self._step.key})" if timeout == self._step.seconds else ""
            self._death = (f"{self.describe()} did not answer the driver's {what} within {timeout:g}s{knob}: "
                           "its host is cut off, or the process hangs")
            logger.error("%s", self._death)
            self._child.close()
            self._on_death(self._death)
        return PSError(self._death)

    def _exit_text(self) -> str:
        return ("its control link to the driver broke: the host is down or cut off, or the process (or the "
                "barrier task that started it) died")

    def _gone(self) -> bool:
        return False  # a remote process is known gone only by its links (the events reader notices)

    def _reap(self) -> None:
        self._child.close()  # the process shuts its shard down when its links close
