"""The stage watchdog against a real parameter server (no Spark needed to decide when to cancel)."""
import threading
import time

import torch

from pipeline.launch.ps_side.watchdog import StageWatchdog
from pipeline.ps import OptimizerSpec, PSClient, ParameterServer, PSSettings, new_secret
from pipeline.wire.deadline import STEP_KEY, Timeout


def _server(secret, world=2):
    settings = PSSettings(OptimizerSpec(), step_timeout=Timeout.of(5, STEP_KEY))
    return ParameterServer(torch.zeros(8), settings, world_size=world, secret=secret, host="127.0.0.1")


def _cancelling_watchdog(server, **deadlines):
    """A watchdog over two ranks, and the event its cancel sets."""
    cancelled = threading.Event()
    return StageWatchdog(server, 2, grace_s=5, cancel=lambda reason: cancelled.set(), **deadlines), cancelled


def test_ranks_that_never_connect_cancel_the_stage_naming_them():
    secret = new_secret()
    with _server(secret) as server:
        with PSClient(*server.address, rank=0, secret=secret, timeout_s=5) as client:
            client.connect()
            watchdog, cancelled = _cancelling_watchdog(server, connect_timeout_s=0.5, poll_s=0.05)
            with watchdog:
                assert cancelled.wait(5)
            assert "rank(s) [1] did not connect" in watchdog.reason and "ps.timeout_s" in watchdog.reason
            assert server.aborted


def test_the_connect_deadline_counts_from_the_first_rank_that_connects():
    secret = new_secret()
    with _server(secret) as server:
        watchdog, cancelled = _cancelling_watchdog(server, connect_timeout_s=0.2, poll_s=0.02, first_connect_s=30)
        with watchdog:
            # Far past connect_timeout_s with nobody connected (Spark still scheduling): no cancel,
            # the 30 s first-connect floor applies.
            assert not cancelled.wait(0.6)
            with PSClient(*server.address, rank=1, secret=secret, timeout_s=5) as client:
                client.connect()
                assert cancelled.wait(5)
        assert "rank(s) [0] did not connect" in watchdog.reason and "of rank(s) [1]" in watchdog.reason


def test_a_stage_where_no_rank_ever_connects_is_cancelled_after_the_first_connect_floor():
    secret = new_secret()
    with _server(secret) as server:
        watchdog, cancelled = _cancelling_watchdog(server, connect_timeout_s=0.1, poll_s=0.02, first_connect_s=0.3)
        with watchdog:
            assert cancelled.wait(5)
        assert "no rank connected to the parameter server within 0.3s" in watchdog.reason
        assert server.aborted


def test_a_healthy_stage_is_left_alone():
    secret = new_secret()
    with _server(secret, world=1) as server:
        with PSClient(*server.address, rank=0, secret=secret, timeout_s=5) as client:
            client.connect()
            with StageWatchdog(server, 1, connect_timeout_s=0.3, grace_s=0.3, cancel=lambda r: None,
                               poll_s=0.05) as watchdog:
                time.sleep(0.8)
            client.finish()
    assert watchdog.reason is None


def test_a_failed_attempt_that_lingers_is_cancelled_after_the_grace_period():
    secret = new_secret()
    reasons = []
    with _server(secret) as server:
        clients = [PSClient(*server.address, rank=rank, secret=secret, timeout_s=5) for rank in (0, 1)]
        try:
            for client in clients:
                client.connect()
            server.fail("rank 1 failed (simulated)")
            with StageWatchdog(server, 2, connect_timeout_s=5, grace_s=0.3, cancel=reasons.append, poll_s=0.05):
                deadline = time.monotonic() + 5
                while not reasons and time.monotonic() < deadline:
                    time.sleep(0.05)
        finally:
            for client in clients:  # closed while the server still runs, so nothing logs after the test
                client.close()
    assert reasons and "did not stop within" in reasons[0]
