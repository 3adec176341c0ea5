"""The allreduce rendezvous: its wait is timeouts.connect_s, and its error says so."""
import socket

import pytest

from pipeline.wire.deadline import CONNECT_KEY, Timeout
from pipeline.worker.distributed import Rendezvous, process_group


def test_a_bare_number_is_timeouts_connect_s_following_ps_timeout_s_and_a_timeout_is_kept():
    assert Rendezvous("h", 1, 5).timeout == Timeout(5.0, CONNECT_KEY, "ps.timeout_s")
    own = Timeout(7.0, CONNECT_KEY)
    assert Rendezvous("h", 1, own).timeout is own


def test_a_rendezvous_no_peer_joins_fails_naming_timeouts_connect_s():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RuntimeError) as caught:
        with process_group(Rendezvous("127.0.0.1", port, Timeout(1.0, CONNECT_KEY)), 0, 2, "cpu"):
            pass
    text = str(caught.value)
    assert "rank 0" in text and f"127.0.0.1:{port}" in text and "2 ranks" in text
    assert "raise timeouts.connect_s" in text
