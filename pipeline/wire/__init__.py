"""The wire every shardline connection speaks: framing, the HMAC handshake, socket options and
deadlines that name the config key that sets them. Shared by the parameter server and the pipeline
stage links; no Spark, no torch.distributed, and torch is not imported to load it.

* :mod:`pipeline.wire.frames` — the 48-byte header, validated before any payload byte is read; the
  :class:`Channel` (exact reads with deadlines, zero-copy sends); JSON payloads with their cap.
* :mod:`pipeline.wire.handshake` — HMAC challenge-response over the per-job secret, bound to rank and
  generation; client and server sides, one-way or mutual (every shardline connection runs it mutually).
* :mod:`pipeline.wire.pending` — slots for unauthenticated connections apart from admitted ones, the
  oldest evicted at the cap, so a flood cannot lock real peers out.
* :mod:`pipeline.wire.tls` — ``ps.tls``: TLS with a per-job self-signed certificate, its fingerprint
  pinned by connectors (imported only when ``ps.tls`` is on).
* :mod:`pipeline.wire.sockets` — socket options, buffer sizes, connect/listen on a specific address.
* :mod:`pipeline.wire.deadline` — :class:`Timeout`: a wait's seconds with the key that sets it.
"""
from pipeline.wire.deadline import CONNECT_KEY, DEFAULT_KEY, LINK_KEY, STEP_KEY, Timeout, deadline_after
from pipeline.wire.frames import Channel, Control, DType, Header, PeerClosedError
from pipeline.wire.handshake import Claim, PeerRefused, Refusal, client_handshake, server_handshake

__all__ = ["CONNECT_KEY", "DEFAULT_KEY", "LINK_KEY", "STEP_KEY", "Timeout", "deadline_after", "Channel",
           "Control", "DType", "Header", "PeerClosedError", "Claim", "PeerRefused", "Refusal",
           "client_handshake", "server_handshake"]
