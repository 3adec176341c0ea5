"""Model buffers on the parameter server: per-rank reports, the merge, checkpoints, new generations and
the wire's checks, on a real server and real clients over 127.0.0.1."""
from functools import partial

import pytest
import torch

from pipeline.errors import ProtocolError, PSError
from pipeline.models.state import encode_buffer, merge_buffers, split_buffers
from pipeline.ps.state.buffers import BufferStore
from pipeline.ps.transport.protocol import DType, Header, MsgType

LAYOUT = (("float32", 2), ("int64", 1))


def _words(mean, count):
    return torch.cat([encode_buffer(torch.tensor(mean, dtype=torch.float32)),
                      encode_buffer(torch.tensor([count], dtype=torch.int64))])


def _store():
    return BufferStore(_words([0.0, 1.0], 0), partial(merge_buffers, LAYOUT))


def test_ranks_push_buffers_the_server_merges_them_and_a_pull_gets_the_attempts_start(make_server, make_client):
    server = make_server(world_size=2, buffers=_store())
    a, b = make_client(server, 0), make_client(server, 1)
    assert a.connect().buffer_words == 4 and b.connect().buffer_words == 4
    assert torch.equal(a.pull_buffers(), _words([0.0, 1.0], 0))  # the initial ones before any report
    a.push_buffers(3, _words([1.0, 2.0], 3))
    b.push_buffers(3, _words([3.0, 4.0], 3))
    mean, count = split_buffers(LAYOUT, server.buffers())
    assert mean.tolist() == [2.0, 3.0] and count.item() == 3
    # A rank (re)connecting within the attempt starts where the attempt did, not from the others' reports
    # (async: one rank may finish before another starts; its counter must not be counted twice).
    assert torch.equal(b.pull_buffers(), _words([0.0, 1.0], 0))
    server.new_generation()  # a new attempt starts from the buffers merged when the last one ended
    retried = make_client(server, 0, generation=server.generation)
    retried.connect()
    assert torch.equal(retried.pull_buffers(), _words([2.0, 3.0], 3))


def test_buffers_survive_checkpoints_and_a_new_generation(make_server, make_client, server_factory, secret):
    server = make_server(world_size=1, buffers=_store())
    c = make_client(server, 0)
    c.connect()
    c.push_buffers(1, _words([5.0, 6.0], 7))
    state = server.state_dict()
    assert torch.equal(state["buffers"], _words([5.0, 6.0], 7))
    server.new_generation()
    assert torch.equal(server.buffers(), _words([5.0, 6.0], 7))  # folded into the base, not lost
    with server_factory(torch.arange(6, dtype=torch.float32), world_size=1, secret=secret,
                        buffers=_store()).start() as resumed:
        resumed.load_state_dict(state)
        assert torch.equal(resumed.buffers(), _words([5.0, 6.0], 7))
        with pytest.raises(PSError, match="buffer"):
            resumed.load_state_dict({**state, "buffers": torch.zeros(3)})


def test_a_sharded_server_keeps_buffers_on_shard_0(make_server, make_client):
    server = make_server(torch.zeros(10), world_size=1, shards=3, buffers=_store())
    c = make_client(server, 0)
    assert c.connect().buffer_words == 4
    c.push_buffers(0, _words([1.0, 1.0], 1))
    assert torch.equal(server.buffers(), _words([1.0, 1.0], 1))
    assert torch.equal(server.state_dict()["buffers"], _words([1.0, 1.0], 1))


def test_a_server_without_buffers_announces_none_and_the_client_refuses(make_server, make_client):
    server = make_server(world_size=1)
    c = make_client(server, 0)
    assert c.connect().buffer_words == 0 and server.buffers().numel() == 0
    with pytest.raises(PSError, match="keeps none"):
        c.push_buffers(0, torch.zeros(4))


def test_a_wrong_buffer_length_is_refused_before_its_payload(make_server, make_client):
    server = make_server(world_size=1, buffers=_store())
    c = make_client(server, 0)
    c.connect()
    with pytest.raises(PSError, match="buffer words"):
        c.push_buffers(0, torch.zeros(5))  # the client checks first
    # A hand-made frame that lies about its count: the server drops the connection as a protocol error.
    link = c._links[0]
    link.channel.send(Header(MsgType.BUFFERS, c.generation, 0, 0, DType.FLOAT32, 5, 20), bytes(20), timeout=1.0)
    with pytest.raises((ProtocolError, PSError)):
        c._gather([link], MsgType.ACK, "ack", c.step_timeout, lambda link, header: header.step)
    assert server.stats["protocol_errors"] == 1
    assert server.buffers().numel() == 4 and not server._buffers.reported_ranks


def test_buffer_frames_are_validated_in_the_header():
    from pipeline.ps.transport.protocol import MAX_BUFFER_WORDS, decode_header

    good = Header(MsgType.BUFFERS, 1, 0, 0, DType.FLOAT32, 4, 16).pack()
    assert decode_header(good, max_elements=0).count == 4  # not capped by the parameter count
    for bad in (Header(MsgType.BUFFERS, 1, 0, 0, DType.FLOAT16, 4, 8),
                Header(MsgType.BUFFERS, 1, 0, 0, DType.FLOAT32, 4, 15),
                Header(MsgType.BUFFERS, 1, 0, 0, DType.FLOAT32, MAX_BUFFER_WORDS + 1, 4 * (MAX_BUFFER_WORDS + 1)),
                Header(MsgType.PULL_BUFFERS, 1, 0, 0, DType.NONE, 0, 4)):
        with pytest.raises(ProtocolError):
            decode_header(bad.pack(), max_elements=100)


def test_each_pipeline_stage_keeps_its_own_buffers_and_checkpoints_them():
    from pipeline.ps import OptimizerSpec, PSClient, PSSettings, new_secret
    from pipeline.ps.server.staged import StagedParameterServer
    from pipeline.wire.deadline import STEP_KEY, Timeout

    secret = new_secret()
    settings = PSSettings(optimizer=OptimizerSpec(lr=0.1), step_timeout=Timeout.of(5, STEP_KEY))
    # stage 0 has buffers, stage 1 has none (its server keeps none and announces none)
    server = StagedParameterServer(torch.arange(10, dtype=torch.float32), [(0, 4), (4, 10)], settings, replicas=1,
                                   secret=secret, host="127.0.0.1", stage_buffers=[_store(), None])
    with server:
        with PSClient(*server.addresses[0], rank=0, secret=secret, timeout_s=5) as stage0, \
                PSClient(*server.addresses[1], rank=0, secret=secret, timeout_s=5) as stage1:
            assert stage0.connect().buffer_words == 4 and stage1.connect().buffer_words == 0
            stage0.push_buffers(0, _words([4.0, 2.0], 9))
        assert torch.equal(server.buffers(), _words([4.0, 2.0], 9))
        state = server.state_dict()
        assert torch.equal(state["stages"][0]["buffers"], _words([4.0, 2.0], 9)) and "buffers" not in state["stages"][1]
    fresh = StagedParameterServer(torch.arange(10, dtype=torch.float32), [(0, 4), (4, 10)], settings, replicas=1,
                                  secret=secret, host="127.0.0.1", stage_buffers=[_store(), None])
    with fresh:
        fresh.load_state_dict(state)
        assert torch.equal(fresh.buffers(), _words([4.0, 2.0], 9))
