"""Deadlines: a Timeout names its key; deadline_after/remaining turn waits into socket timeouts."""
import time

import pytest

from pipeline.errors import PSError, PSTimeoutError
from pipeline.wire.deadline import CONNECT_KEY, LINK_KEY, STEP_KEY, Timeout, deadline_after, remaining


def test_a_bare_number_follows_the_catch_all_key() -> None:
    wait = Timeout.of(0.5, STEP_KEY)
    assert wait.message("the ACK") == ("timed out after 0.5s waiting for the ACK; "
                                       "raise timeouts.step_s (unset: it follows ps.timeout_s)")
    assert Timeout.of(wait, CONNECT_KEY) is wait  # a Timeout stays what it is
    assert Timeout(2, LINK_KEY).hint == "raise timeouts.link_s"
    assert isinstance(Timeout(2, LINK_KEY).error("x", why="y"), PSTimeoutError)
    assert "x; y; raise timeouts.link_s" in str(Timeout(2, LINK_KEY).error("x", why="y"))


def test_a_timeout_must_be_positive_and_names_its_key() -> None:
    with pytest.raises(PSError, match=r"timeouts.connect_s \(from ps.timeout_s\) must be > 0, got 0"):
        Timeout.of(0, CONNECT_KEY)


def test_deadline_after_and_remaining() -> None:
    assert deadline_after(None) is None and remaining(None) is None
    start = time.monotonic()
    assert start + 4 < deadline_after(Timeout(5, STEP_KEY)) <= time.monotonic() + 5
    assert 0 < remaining(deadline_after(5.0)) <= 5
    with pytest.raises(TimeoutError):
        remaining(time.monotonic() - 1)
