"""A wait's length together with the config key that sets it (after Horovod's ``common/util/timeout.py``).

Every timeout error in shardline is built from a :class:`Timeout`, so the message always names its own
knob: ``raise timeouts.step_s`` — and, when that key is unset and the value came from the catch-all
``ps.timeout_s``, says so, since raising either fixes it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Union

from pipeline.errors import PSError, PSTimeoutError

# The catch-all key: the default of every wait whose own key is unset.
DEFAULT_KEY = "ps.timeout_s"
STEP_KEY = "timeouts.step_s"  # per-step PS waits: a step's pushes, a pull, a rank's turn
CONNECT_KEY = "timeouts.connect_s"  # rendezvous: connecting to the PS, process groups, stage-link accepts
LINK_KEY = "timeouts.link_s"  # pipeline stage links: activations and gradients per micro-batch


@dataclass(frozen=True)
class Timeout:
    """``seconds`` of waiting, set by config ``key``; ``inherited_from`` names the key it took its value
    from when ``key`` itself was unset (then the hint names both)."""

    seconds: float
    key: str = DEFAULT_KEY
    inherited_from: Optional[str] = None

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            where = f"{self.key} (from {self.inherited_from})" if self.inherited_from else self.key
            raise PSError(f"{where} must be > 0, got {self.seconds}")

    @classmethod
    def of(cls, value: Union["Timeout", float, int], key: str = DEFAULT_KEY) -> "Timeout":
        """``value`` as a Timeout: a Timeout as it is; a bare number as ``key`` following ps.timeout_s."""
        if isinstance(value, Timeout):
            return value
        return cls(float(value), key, None if key == DEFAULT_KEY else DEFAULT_KEY)

    @property
    def hint(self) -> str:
        """The fix, for the end of an error message."""
        if self.inherited_from:
            return f"raise {self.key} (unset: it follows {self.inherited_from})"
        return f"raise {self.key}"

    def message(self, what: str, *, why: str = "") -> str:
        """``timed out after 2s waiting for <what>[; <why>]; raise <key>``."""
        return f"timed out after {self.seconds:g}s waiting for {what}{'; ' + why if why else ''}; {self.hint}"

    def error(self, what: str, *, why: str = "") -> PSTimeoutError:
        return PSTimeoutError(self.message(what, why=why))

    def shorter(self, seconds: float) -> "Timeout":
        """The same knob capped at ``seconds`` (e.g. a grace period that never exceeds the wait it bounds)."""
        return Timeout(min(self.seconds, seconds), self.key, self.inherited_from)


def deadline_after(wait: Union[Timeout, float, None]) -> Optional[float]:
    """The monotonic time at which a wait of ``wait`` (seconds or a Timeout) starting now runs out;
    None means wait without limit. The one way to turn a wait into a deadline."""
    if wait is None:
        return None
    return time.monotonic() + (wait.seconds if isinstance(wait, Timeout) else wait)


def remaining(deadline: Optional[float]) -> Optional[float]:
    """Seconds left until ``deadline`` (None: no limit); raises TimeoutError once it has passed, so a
    socket wait that has no time left fails the same way as one that ran out."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left
