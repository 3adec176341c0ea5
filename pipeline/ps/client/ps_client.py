"""The worker side of the parameter-server wire: one blocking method per message.

Why the client deadlines are what they are: the server answers a PULL only after every rank has
pushed, and it fails a PULL itself after ``ps.timeout_s`` with a message naming the missing ranks.
The client therefore waits a little longer than ``timeout_s`` for PULL answers, so that the
server's (more informative) error arrives first; its own timeout only fires when the server itself
is unreachable. Every timeout error names the key of its wait: ``timeouts.step_s`` for the per-step
waits, ``timeouts.connect_s`` for connecting and the handshake (each follows ``ps.timeout_s`` when
unset). A client is used by one thread (the worker's training loop).

Shards (``ps.shards``): the address a worker is given is shard 0's; its WELCOME lists every shard's
address and ``[start, end)`` slice, and the client keeps one authenticated connection per shard
(``_Link``). A PULL or PUSH is fanned out without threads: the request goes to every shard first,
then the replies are read in shard order, so the shards work on it concurrently. PARAMS are received
straight into each shard's slice of one preallocated buffer, and each shard's slice of a gradient is
encoded (compressed) and sent from its own memory. A shard's ERROR reply is only raised after every
other shard's reply to the same request was read, so all connections stay in step.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch

from pipeline.errors import NonFiniteError, PSError, PSTimeoutError, ProtocolError, is_retryable
from pipeline.ps.client.buffer_requests import BufferRequests
from pipeline.ps.client.bucket_rounds import BucketRounds
from pipeline.ps.modes.compression import Compressor
from pipeline.ps.server.meeting import RendezvousRequests
from pipeline.ps.transport.opening import Opening, open_shard
from pipeline.ps.transport.protocol import Channel, Header, MsgType, ServerInfo, ShardInfo
from pipeline.ps.transport.shm_offer import page_params
from pipeline.wire.deadline import CONNECT_KEY, STEP_KEY, Timeout, deadline_after
from pipeline.wire.frames import U32_MAX, PeerClosedError

if TYPE_CHECKING:  # ps.tls only
    from pipeline.wire.tls import PinnedCert

__all__ = ["PSClient", "ServerInfo", "ShardInfo"]  # the WELCOME types live in protocol.py

logger = logging.getLogger(__name__)

_MAX_FAIL_ERROR_CHARS = 16 * 1024
_MAX_FAIL_LOG_CHARS = 256 * 1024
_FAIL_TIMEOUT_S = 5.0


@dataclass(eq=False)
class _Link:
    """The connection to one shard."""

    index: int
    host: str
    port: int
    start: int
    end: int
    channel: Channel
    compressor: Compressor | None = None

    @property
    def size(self) -> int:
        return self.end - self.start


def _pull_wait(timeout: Timeout) -> Timeout:
    """How long a PULL may take: the server's own deadline plus a margin for its ERROR to arrive."""
    return dataclasses.replace(timeout, seconds=timeout.seconds + max(0.5, 0.25 * timeout.seconds))


class PSClient(BufferRequests, BucketRounds, RendezvousRequests):
    """Blocking client of one worker rank. Context manager: connects on enter, closes on exit
    (sending a best-effort FAIL if the block raised). Call ``finish()`` when training is done;
    closing without it is recorded by the server as a failure of this rank.

    ``timeout_s`` bounds the per-step waits (a float is ``timeouts.step_s`` following ``ps.timeout_s``);
    ``connect_timeout`` bounds connecting and the handshake (``timeouts.connect_s``; None: as long as
    ``timeout_s``)."""

    def __init__(self, host: str, port: int, *, rank: int, secret: bytes, generation: int = 1,
                 timeout_s: Union[float, Timeout] = 60.0,
                 connect_timeout: Union[float, Timeout, None] = None,
                 log_tail: Callable[[], str] | None = None, expected_params: Optional[int] = None,
                 expected_buffer_words: Optional[int] = None, tls: Optional[PinnedCert] = None) -> None:
        if not 0 <= rank <= U32_MAX or not 0 <= generation <= U32_MAX:
            raise PSError(f"rank {rank} and generation {generation} must fit an unsigned 32-bit field")
        self.step_timeout = Timeout.of(timeout_s, STEP_KEY)
        self.connect_timeout = Timeout.of(
            self.step_timeout.seconds if connect_timeout is None else connect_timeout, CONNECT_KEY)
        self.host = host
        self.port = int(port)
        self.rank = rank
        self.generation = generation
        self.timeout_s = self.step_timeout.seconds
        # How long a PULL or PUSH reply may take (computed once: it is on every step's path).
        self._reply_wait = _pull_wait(self.step_timeout)
        # The FAIL sent when the `with` body raises carries this rank's recent log lines.
        self._log_tail = log_tail
        # train.profile: called with "push" once a PUSH_PULL's gradient is sent (pipeline.worker.timing).
        self.phase_hook: Optional[Callable[[str], None]] = None
        self._secret = bytes(secret)
        # The sizes of the model this worker built: every WELCOME is held against them before the
        # client allocates anything it announces (a forged or confused server is refused).
        self.expected_params = expected_params
        self.expected_buffer_words = expected_buffer_words
        self._opening = Opening(rank, generation, self._secret, expected_params, expected_buffer_words, tls)
        self._links: list[_Link] = []
        self._info: ServerInfo | None = None
        self._params_buf: bytearray | None = None
        self._params: torch.Tensor | None = None
        self._ever_connected = False
        self._failure_reported = False
        # Kept across reconnects, per shard slice: the top-k residual is gradient not yet sent.
        self._compressors: dict[tuple[int, int], Compressor] = {}

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> PSClient:
        self.connect()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is not None:
            self.report_failure(exc)
        self.close()

    def report_failure(self, exc: BaseException) -> None:
        """FAIL for ``exc`` with this rank's log tail, once (a later call for the same failure is a no-op).
        A PSError is the server's side of a failure it already knows about: nothing is sent for it — except
        NonFiniteError, which a worker also raises itself (a NaN/Inf loss) and the server must hear as the cause.
        The FAIL says whether another attempt could succeed (``errors.is_retryable``), so the driver
        does not retry what would fail the same way.

        Called early by code that tears down something peers wait on (a process group), so the server
        hears the cause before the consequences."""
        if (isinstance(exc, PSError) and not isinstance(exc, NonFiniteError)) or self._failure_reported:
            return
        self._failure_reported = True
        tail = ""
        if self._log_tail is not None:
            try:
                tail = self._log_tail()
            except Exception:  # a log tail is a nicety; the FAIL itself must go out
                tail = ""
        self.fail(f"{type(exc).__name__}: {exc}", tail, retryable=is_retryable(exc))

    @property
    def info(self) -> ServerInfo | None:
        """The WELCOME of the current connection, or None when not connected."""
        return self._info

    @property
    def num_shards(self) -> int:
        return len(self._links)

    def connect(self) -> ServerInfo:
        """Connect and authenticate both ways (CHALLENGE -> AUTH + CHALLENGE -> AUTH -> WELCOME,
        ``pipeline.ps.transport.opening``) with shard 0, then with every other shard its WELCOME lists, each WELCOME
        held against this worker's model sizes. Idempotent while connected."""
        return self._connect(self.connect_timeout)

    def _connect(self, timeout: Timeout) -> ServerInfo:
        if self._links and self._info is not None:
            return self._info
        self._ever_connected = True
        channel, info = self._handshake(self.host, self.port, timeout)
        shards = info.shards or (ShardInfo(self.host, self.port, 0, info.num_params),)
        links = [_Link(0, self.host, self.port, shards[0].start, shards[0].end, channel)]
        try:
            for index, shard in enumerate(shards[1:], start=1):
                other, other_info = self._handshake(shard.host, shard.port, timeout)
                links.append(_Link(index, shard.host, shard.port, shard.start, shard.end, other))
                if (other_info.num_params, other_info.shards, other_info.mode, other_info.sparse_shards) != (
                        info.num_params, info.shards, info.mode, info.sparse_shards):
                    raise ProtocolError(f"shard {index} at {shard.host}:{shard.port} announced a different "
                                        f"model or layout than shard 0")
        except BaseException:
            for link in links:
                link.channel.close()
            raise
        for link in links:
            link.channel.max_elements = link.size
            key = (link.start, link.end)
            compressor = self._compressors.get(key)
            if compressor is None or compressor.compression != info.compression:
                compressor = self._compressors[key] = Compressor(info.compression, link.size, info.topk_ratio)
            link.compressor = compressor
        self._links = links
        self._info = info
        if self._params_buf is None or len(self._params_buf) != info.num_params * 4:
            self._params_buf = bytearray(info.num_params * 4)
            self._params = torch.frombuffer(self._params_buf, dtype=torch.float32, count=info.num_params)
        logger.info("rank %s connected to the parameter server at %s:%s (version %s, %s shard(s))",
                    self.rank, self.host, self.port, info.version, len(links))
        return info

    def _handshake(self, host: str, port: int, timeout: Timeout) -> tuple[Channel, ServerInfo]:
        """One shard's connection, mutually authenticated, its WELCOME checked (``pipeline.ps.transport.opening``)."""
        return open_shard(self._opening, host, port, timeout)

    def close(self) -> None:
        """Close every shard connection. Idempotent; never raises."""
        links, self._links, self._info = self._links, [], None
        for link in links:
            link.channel.close()

    # -- requests --------------------------------------------------------------------------------
    def pull(self, min_version: int = 0) -> tuple[int, torch.Tensor]:
        """Wait until every shard's version is >= ``min_version`` and return (version, params); with
        several shards the version is the lowest any shard returned.

        The returned tensor is a view of this client's reusable receive buffer, or (one shard, shared
        memory) of the ring the reply lies in: either may be overwritten after the next ``pull``, so
        copy it (e.g. into the model) or stop using it before pulling again.
        """
        links = self._require()
        what = f"parameters of version >= {min_version}"
        self._send_all(links, lambda link: link.channel.send_empty(
            MsgType.PULL, generation=self.generation, rank=self.rank, step=min_version,
            timeout=self.timeout_s), what)
        return self._receive_params(links, what)

    def _receive_params(self, links: list[_Link], what: str) -> tuple[int, torch.Tensor]:
        """Read every shard's PARAMS reply straight into its slice of the reusable buffer; from one shard
        whose reply lies in the shared-memory ring, take it where it lies instead (no copy: issue 17, the
        round's serial tail), held in the ring until the next PARAMS."""
        wait = self._reply_wait
        assert self._params_buf is not None and self._params is not None
        view = memoryview(self._params_buf)
        in_place: list[torch.Tensor] = []

        def receive(link: _Link, header: Header) -> int:
            if header.type is MsgType.PARAMS_SHARED:
                return self._params_from_page(link, header, in_place if len(links) == 1 else None)
            if header.count != link.size:
                raise ProtocolError(f"PARAMS of {header.count} elements from shard {link.index}, "
                                    f"expected {link.size}")
            held = link.channel.recv_in_place(header) if len(links) == 1 else None
            if held is not None:
                in_place.append(held.view(torch.float32))
            else:
                link.channel.drop_in_place()
                link.channel.recv_into(header, view[link.start * 4:link.end * 4], deadline_after(wait))
            return header.step

        versions = self._gather(links, MsgType.PARAMS, what, wait, receive)
        return min(versions), (in_place[0] if in_place else self._params)

    def _params_from_page(self, link: _Link, header: Header, in_place: list[torch.Tensor] | None) -> int:
        """PARAMS_SHARED: one shard's page is taken where it lies, several shards' copied into the buffer."""
        page = page_params(link.channel, link.size, link.index)
        if in_place is not None:
            in_place.append(page)
        else:
            self._params[link.start:link.end].copy_(page)
        return header.step

    @property
    def compressor(self) -> Compressor | None:
        """The push encoder chosen by the server's ``ps.compression`` (shard 0's slice with several
        shards; None before connecting)."""
        return self._links[0].compressor if self._links else None

    def push(self, step: int, grad: torch.Tensor) -> int:
        """Send this rank's gradient (``average`` mode: parameter delta) for ``step``, each shard its
        slice, encoded as the server's ``ps.compression`` says, and wait for every ACK. Returns the ACK's
        step: in ``async`` mode the (lowest over shards) version the gradient was applied to,
        otherwise ``step``.

        ``grad`` must hold ``num_params`` values; non-fp32/non-contiguous/GPU tensors are converted
        (one copy), fp32 contiguous CPU tensors are sent from their own memory when uncompressed.
        """
        links = self._require()
        assert self._info is not None
        what = f"the ACK of the gradient for step {step}"
        self._send_gradient(links, MsgType.PUSH, self._flat_gradient(step, grad), step, what)
        return min(self._gather(links, MsgType.ACK, what, self._reply_wait,
                                lambda link, header: header.step))

    def push_pull(self, step: int, grad: torch.Tensor) -> tuple[int, torch.Tensor]:
        """``push(step, grad)`` then ``pull(step + 1)`` in one round trip per shard (``PUSH_PULL``):
        each shard answers with the PARAMS of the next version once the step is applied (sync,
        average; ssp: once clock ``step + 1`` is within the bound). Not available in async mode, where
        the push's ACK carries the version it was applied to. Same return value as ``pull``.
        """
        links = self._require()
        assert self._info is not None
        if self._info.mode == "async":
            raise PSError("push_pull is not available in async mode; use push() then pull()")
        what = f"parameters of version >= {step + 1} after the gradient for step {step}"
        self._send_gradient(links, MsgType.PUSH_PULL, self._flat_gradient(step, grad), step, what)
        if self.phase_hook is not None:
            self.phase_hook("push")
        return self._receive_params(links, what)

    def _send_gradient(self, links: list[_Link], msg_type: MsgType, flat: torch.Tensor, step: int,
                       what: str) -> None:
        """Each shard's slice of the gradient, compressed per shard, sent to every shard before any reply."""

        def send(link: _Link) -> None:
            assert link.compressor is not None
            encoded = link.compressor.encode(flat[link.start:link.end])
            link.channel.send_payload(msg_type, encoded.payload, encoded.dtype, encoded.count,
                                      generation=self.generation, rank=self.rank, step=step,
                                      timeout=self.timeout_s)

        self._send_all(links, send, what)

    def report(self, metrics: dict[str, Any]) -> None:
        """Send a metrics dict (JSON, <= 1 MiB) to the driver's ``on_metrics`` (via shard 0) and wait
        for its ACK."""
        links = self._require()[:1]
        what = "the ACK of a metrics report"
        self._send_all(links, lambda link: link.channel.send_json(
            MsgType.METRICS, dict(metrics), generation=self.generation, rank=self.rank,
            timeout=self.timeout_s), what)
        self._gather(links, MsgType.ACK, what, self.step_timeout, lambda link, header: header.step)

    def fail(self, error: str, log_tail: str = "", retryable: bool = True) -> None:
        """Tell every shard this rank failed, so its peers stop waiting at once; ``retryable`` False:
        another attempt would fail the same way (recorded on the server's WorkerFailure). Best effort:
        never raises, connects first if this client never connected, waits a few seconds at most."""
        wait = self.step_timeout.shorter(_FAIL_TIMEOUT_S)
        try:
            if not self._links and not self._ever_connected:
                self._connect(self.connect_timeout.shorter(_FAIL_TIMEOUT_S))
            links = self._require()
            body = {"error": str(error)[:_MAX_FAIL_ERROR_CHARS],
                    "log_tail": str(log_tail)[-_MAX_FAIL_LOG_CHARS:], "retryable": bool(retryable)}
            what = "the ACK of a FAIL report"
            self._send_all(links, lambda link: link.channel.send_json(
                MsgType.FAIL, body, generation=self.generation, rank=self.rank, timeout=wait.seconds), what)
            self._gather(links, MsgType.ACK, what, wait, lambda link, header: header.step)
        except Exception as exc:  # best effort by contract
            logger.warning("rank %s could not report its failure to the parameter server: %s",
                           self.rank, exc)

    def finish(self) -> None:
        """Tell every shard this rank is done (so its disconnect is not a failure), then close."""
        links = self._require()
        what = "the ACK of FINISH"
        try:
            self._send_all(links, lambda link: link.channel.send_empty(
                MsgType.FINISH, generation=self.generation, rank=self.rank, timeout=self.timeout_s), what)
            self._gather(links, MsgType.ACK, what, self.step_timeout, lambda link, header: header.step)
        finally:
            self.close()

    # -- helpers ---------------------------------------------------------------------------------
    def _flat_gradient(self, step: int, grad: torch.Tensor) -> torch.Tensor:
        assert self._info is not None
        flat = grad.detach().reshape(-1)
        if flat.numel() != self._info.num_params:
            raise PSError(f"rank {self.rank} pushed {flat.numel()} gradient values for step {step}, "
                          f"the server holds {self._info.num_params} parameters")
        if flat.dtype != torch.float32 or flat.device.type != "cpu" or not flat.is_contiguous():
            flat = flat.to(device="cpu", dtype=torch.float32).contiguous()
        return flat

    def _require(self) -> list[_Link]:
        if not self._links:
            raise PSError(f"rank {self.rank} is not connected to the parameter server (call connect())")
        return self._links

    def _drop(self) -> None:
        """After a timeout or a broken frame a stream is out of sync: close every connection (the
        shards see this rank's drop)."""
        self.close()

    def _send_all(self, links: list[_Link], action: Callable[[_Link], None], what: str) -> None:
        """Send one request to each link. PSError raised while encoding, before any byte of the frame
        went out, leaves the streams in sync only if it happens at the first link; later ones drop."""
        for i, link in enumerate(links):
            try:
                action(link)
            except PSError:
                if i:
                    self._drop()
                raise
            except Exception as exc:
                self._drop()
                raise self._translate(exc, link, f"sending the request for {what}", self.step_timeout) from None

    def _gather(self, links: list[_Link], msg_type: MsgType, what: str, wait: Timeout,
                receive: Callable[[_Link, Header], int]) -> list[int]:
        """Read each link's reply (``receive`` reads a payload and returns a step). A server ERROR is
        raised after the other links' replies were read; a broken stream drops every link at once."""
        results: list[int] = []
        refused: PSError | None = None
        for link in links:
            deadline = deadline_after(wait)
            try:
                header = link.channel.recv_header(deadline)
                if header.type is MsgType.ERROR:
                    body = link.channel.recv_json(header, deadline)
                elif header.type is not msg_type and not (msg_type is MsgType.PARAMS
                                                          and header.type is MsgType.PARAMS_SHARED):
                    raise ProtocolError(f"expected {msg_type.name} while waiting for {what}, "
                                        f"got {header.type.name}")
                else:
                    results.append(receive(link, header))
                    continue
            except Exception as exc:
                self._drop()
                # The server's own explanation, if a shard already gave one, beats a broken stream.
                raise (refused or self._translate(exc, link, what, wait)) from None
            error = self._refusal(body)
            refused = refused or error
            if isinstance(error, ProtocolError):
                self._drop()
                raise error
        if refused is not None:
            raise refused
        return results

    @staticmethod
    def _refusal(body: dict[str, Any]) -> PSError:
        text = str(body.get("error", "unspecified error"))
        if body.get("kind") == "timeout":
            return PSTimeoutError(text)
        if body.get("kind") == "protocol":
            return ProtocolError(text)
        if body.get("kind") == "nonfinite":  # the same numbers would fail again: not retried
            return NonFiniteError(text)
        return PSError(text)

    def _translate(self, exc: Exception, link: _Link, what: str, wait: Timeout) -> PSError:
        if isinstance(exc, TimeoutError):
            return self._timeout_error(what, wait, link)
        if isinstance(exc, PeerClosedError):
            return PSError(f"the parameter server at {link.host}:{link.port} closed the connection of "
                           f"rank {self.rank} while it waited for {what}")
        if isinstance(exc, PSError):
            return exc
        if isinstance(exc, OSError):
            return PSError(f"rank {self.rank} lost its connection to the parameter server at "
                           f"{link.host}:{link.port} while waiting for {what}: {exc}")
        return PSError(f"rank {self.rank}: unexpected error while waiting for {what}: {exc!r}")

    def _timeout_error(self, what: str, wait: Timeout, link: Optional[_Link] = None, *,
                       at: bool = True) -> PSTimeoutError:
        """"rank R timed out after Xs waiting for <what> [from the parameter server at H:P]; raise <key>"."""
        if at:
            host, port = (link.host, link.port) if link is not None else (self.host, self.port)
            what = f"{what} from the parameter server at {host}:{port}"
        return PSTimeoutError(f"rank {self.rank} {wait.message(what)}")
