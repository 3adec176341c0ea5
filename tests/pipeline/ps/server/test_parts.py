"""The shard's parts: the policy table per mode, the dispatch table per message type, refusal kinds
the worker sees as their own exception types, deadlines that name their key, the fan-out helper."""
from __future__ import annotations

import socket

import pytest
import torch

from pipeline.errors import NonFiniteError, PSError, PSTimeoutError
from pipeline.ps import OptimizerSpec, ParameterServer, PSSettings, new_secret
from pipeline.ps.server.dispatch import HANDLERS
from pipeline.ps.server.fanout import MixedVersionsText, ServerGroup
from pipeline.ps.modes.consistency import MODES, Consistency
from pipeline.ps.modes.policies import POLICIES
from pipeline.ps.transport.protocol import MsgType
from pipeline.ps.server.shard import ShardServer
from pipeline.wire.deadline import STEP_KEY, Timeout


def test_one_policy_per_mode_as_the_worker_has_one_exchange_per_mode():
    from pipeline.worker.exchange import EXCHANGES

    assert set(POLICIES) == set(MODES) == set(EXCHANGES)
    assert all(POLICIES[mode].mode == mode for mode in MODES)


def test_one_handler_per_message_a_worker_sends():
    assert set(HANDLERS) == {MsgType.PUSH, MsgType.PUSH_PULL, MsgType.PULL, MsgType.METRICS, MsgType.FAIL,
                             MsgType.FINISH, MsgType.BUFFERS, MsgType.PULL_BUFFERS,
                             MsgType.SPARSE_PULL, MsgType.SPARSE_PUSH, MsgType.SHM_REQUEST, MsgType.SHM_ATTACHED,
                             MsgType.RENDEZVOUS}


@pytest.mark.parametrize("mode", ["sync", "ssp", "async", "average"])
def test_a_nan_push_reaches_the_worker_as_non_finite_error(make_server, make_client, mode):
    server = make_server(world_size=1, consistency=Consistency(mode))
    with make_client(server, 0) as c:
        with pytest.raises(NonFiniteError, match="NaN/Inf for step 0"):
            c.push(0, torch.tensor([0, 1, float("nan"), 0, 0, 0.0]))
        c.finish()
    assert server.version == 0


def test_a_step_deadline_of_its_own_key_names_only_that_key(secret, make_client):
    settings = PSSettings(optimizer=OptimizerSpec(), step_timeout=Timeout(0.3, STEP_KEY))
    with ParameterServer(torch.zeros(6), settings, world_size=2, secret=secret, host="127.0.0.1") as server:
        with make_client(server, 0) as c:
            c.push(0, torch.ones(6))
            with pytest.raises(PSTimeoutError, match=r"rank\(s\) 1 had not pushed step 0") as info:
                c.pull(1)
    text = str(info.value)
    assert "raise timeouts.step_s if these workers are only slow" in text and "ps.timeout_s" not in text


def test_an_inherited_step_deadline_says_what_it_follows(make_server, make_client):
    server = make_server(world_size=1, consistency=Consistency("async"), timeout_s=0.2)
    with make_client(server, 0) as c:
        with pytest.raises(PSTimeoutError, match=r"version 5 \(at 0\); raise timeouts\.step_s "
                                                 r"\(unset: it follows ps\.timeout_s\)"):
            c.pull(5)
        c.finish()


def _shard(secret: bytes) -> ShardServer:
    return ShardServer(torch.zeros(4), PSSettings(optimizer=OptimizerSpec()), world_size=1, secret=secret,
                       host="127.0.0.1")


def test_a_group_starts_every_member_or_closes_those_it_started():
    secret = new_secret()
    first, second = _shard(secret), _shard(secret).start()  # the second cannot start again
    group = ServerGroup([first, second], name="shards", mixed=MixedVersionsText("shards", "", "fix"))
    try:
        with pytest.raises(PSError, match="already started"):
            group.start()
        assert first.aborted  # closed by the group, not left listening
        with pytest.raises(OSError):
            socket.create_connection(first.address, timeout=1).close()
    finally:
        group.close()


def test_a_group_refuses_a_new_generation_at_different_versions_only_when_asked():
    secret = new_secret()
    shards = [_shard(secret), _shard(secret)]
    group = ServerGroup(shards, name="shards", mixed=MixedVersionsText("shards", " (why)", "the fix"))
    shards[1].load_state_dict({**shards[1].state_dict(), "version": 3})
    with pytest.raises(PSError, match=r"shards are at different versions \[0, 3\]: a step was applied on "
                                      r"some shards only \(why\); the fix"):
        group.new_generation(None, refuse_mixed_versions=True)
    assert group.new_generation(None, refuse_mixed_versions=False) == 2
    assert group.version == 0 and group.generation == 2
    group.close()
