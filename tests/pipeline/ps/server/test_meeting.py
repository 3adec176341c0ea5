"""The allreduce rendezvous through the parameter server (RENDEZVOUS, pipeline.ps.server.meeting): real servers
and clients on 127.0.0.1, ranks in threads."""
import re

import pytest

from pipeline.errors import ProtocolError, PSError, PSTimeoutError
from pipeline.ps.transport.protocol import MsgType


def test_every_rank_gets_every_offer_in_rank_order(make_server, make_client, background):
    server = make_server(world_size=3, timeout_s=30)
    clients = [make_client(server, rank) for rank in range(3)]
    for c in clients:
        c.connect()
    offers = [{"device": "cpu", "allreduce": ["127.0.0.1", 4242]}, {"device": "cpu"}, {"device": "cuda"}]
    # Offered out of rank order; the last one completes the meeting and everyone is answered.
    waiting = [background(lambda c=clients[r], o=offers[r]: c.rendezvous(o)) for r in (2, 0)]
    assert clients[1].rendezvous(offers[1]) == offers
    assert [w.result() for w in waiting] == [offers, offers]


@pytest.mark.parametrize("how", ["fail", "disconnect", "finish", "driver aborts", "new generation"])
def test_a_failed_or_finished_peer_or_the_driver_ends_the_wait_at_once(make_server, make_client, background, how):
    server = make_server(world_size=2, timeout_s=30)  # only failing fast can end the wait within the test
    c0, c1 = make_client(server, 0), make_client(server, 1)
    c0.connect()
    c1.connect()
    waiter = background(lambda: c0.rendezvous({"device": "cpu"}))
    expected = {"fail": ("rank(s) 1 failed, so the allreduce rendezvous cannot complete",),
                "disconnect": ("rank(s) 1 failed, so the allreduce rendezvous cannot complete",),
                "finish": ("rank(s) 1 finished without a rendezvous offer",),
                "driver aborts": ("the driver gave up on this attempt",),
                # new_generation() cuts the old connections at once: the waiter reads its ERROR or the cut.
                "new generation": ("generation 1 was superseded by generation 2",
                                   "closed the connection of rank 0 while it waited for every rank's "
                                   "rendezvous offer")}[how]
    if how == "fail":
        c1.fail("rank 1 could not pick its device")
    elif how == "disconnect":
        c1.close()
    elif how == "finish":
        c1.finish()
    elif how == "driver aborts":
        server.fail("the driver gave up on this attempt")
    else:
        server.new_generation()
    error = waiter.outcome()
    assert isinstance(error, PSError) and not isinstance(error, PSTimeoutError), error
    assert any(text in str(error) for text in expected), error
    if how == "fail":
        assert "could not pick its device" in str(error)


def test_the_wait_has_the_step_deadline_naming_the_missing_ranks(make_server, make_client):
    server = make_server(world_size=3, timeout_s=0.3)
    with make_client(server, 0) as c0, make_client(server, 1) as c1:
        c1.connect()
        with pytest.raises(PSTimeoutError) as info:
            c0.rendezvous({"device": "cpu"})
    text = str(info.value)
    assert "allreduce rendezvous: rank(s) 1, 2 sent no offer" in text
    assert "rank(s) 2 never connected" in text and "ps.timeout_s" in text


def test_one_offer_per_rank_and_generation_and_a_new_generation_meets_again(make_server, make_client):
    server = make_server(world_size=1)
    c = make_client(server, 0)
    c.connect()
    assert c.rendezvous({"device": "cpu"}) == [{"device": "cpu"}]
    with pytest.raises(PSError, match="already sent its rendezvous offer in generation 1"):
        c.rendezvous({"device": "cpu"})
    server.new_generation()
    retried = make_client(server, 0, generation=server.generation)
    retried.connect()
    assert retried.rendezvous({"device": "cuda"}) == [{"device": "cuda"}]


@pytest.mark.parametrize("offer, why", [
    (["cpu"], "an object with 'device'"),
    ({"device": "cpu", "extra": "x" * 900_000}, "an object with 'device'"),
    ({"device": "tpu"}, "'device' one of"),
    ({"device": "cpu", "allreduce": ["h" * 300, 80]}, "'allreduce' a [host, port] pair"),
    ({"device": "cpu", "allreduce": ["127.0.0.1", "80"]}, "'allreduce' a [host, port] pair"),
    ({"device": "cpu", "allreduce": ["127.0.0.1", 70000]}, "'allreduce' a [host, port] pair"),
])
def test_an_offer_that_is_not_a_device_and_an_address_is_a_protocol_error(make_server, make_client, offer, why):
    server = make_server(world_size=1)
    c = make_client(server, 0)
    c.connect()
    link = c._require()[0]
    link.channel.send_json(MsgType.RENDEZVOUS, {"offer": offer}, generation=c.generation, rank=0, timeout=1.0)
    with pytest.raises(ProtocolError, match=re.escape(f"RENDEZVOUS offer is {why}")):
        c._gather([link], MsgType.RENDEZVOUS, "offers", c.step_timeout, lambda link, header: header.step)
    assert server.stats["protocol_errors"] == 1


def test_a_rendezvous_sent_to_any_shard_but_the_first_is_a_protocol_error(make_server, make_client):
    server = make_server(world_size=1, shards=2)
    c = make_client(server, 0)
    c.connect()
    link = c._require()[1]
    link.channel.send_json(MsgType.RENDEZVOUS, {"offer": {"device": "cpu"}}, generation=c.generation, rank=0,
                           timeout=1.0)
    with pytest.raises(ProtocolError, match="a RENDEZVOUS goes to shard 0, this is shard 1"):
        c._gather([link], MsgType.RENDEZVOUS, "offers", c.step_timeout, lambda link, header: header.step)
    assert server.stats["protocol_errors"] == 1
