"""The worker side of the parameter-server wire: one blocking method per message.

Why the client deadlines are what they are: the server answers a PULL only after every rank has
pushed, and it fails a PULL itself after ``ps.timeout_s`` with a message naming the missing ranks.
The client therefore waits a little longer than ``timeout_s`` for PULL answers, so that the
server's (more informative) error arrives first; its own timeout only fires when the server itself
is unreachable. A client is used by one thread (the worker's training loop).
"""
from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from pipeline.errors import AuthenticationError, PSError, PSTimeoutError, ProtocolError
from pipeline.ps.protocol import (
    U32_MAX,
    Channel,
    Header,
    MsgType,
    PeerClosedError,
    auth_mac,
    deadline_after,
    decode_tensor,
    set_socket_options,
)

logger = logging.getLogger(__name__)

TIMEOUT_KEY = "ps.timeout_s"
_MAX_FAIL_ERROR_CHARS = 16 * 1024
_MAX_FAIL_LOG_CHARS = 256 * 1024
_FAIL_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ServerInfo:
    """What the server announced in WELCOME."""

    num_params: int
    version: int
    world_size: int


def _pull_wait_s(timeout_s: float) -> float:
    """How long a PULL may take: the server's own deadline plus a margin for its ERROR to arrive."""
    return timeout_s + max(0.5, 0.25 * timeout_s)


class PSClient:
    """Blocking client of one worker rank. Context manager: connects on enter, closes on exit
    (sending a best-effort FAIL if the block raised). Call ``finish()`` when training is done;
    closing without it is recorded by the server as a failure of this rank."""

    def __init__(self, host: str, port: int, *, rank: int, secret: bytes, generation: int = 1,
                 timeout_s: float = 60.0) -> None:
        if not 0 <= rank <= U32_MAX or not 0 <= generation <= U32_MAX:
            raise PSError(f"rank {rank} and generation {generation} must fit an unsigned 32-bit field")
        if not timeout_s > 0:
            raise PSError(f"{TIMEOUT_KEY} must be > 0, got {timeout_s}")
        self.host = host
        self.port = int(port)
        self.rank = rank
        self.generation = generation
        self.timeout_s = float(timeout_s)
        self._secret = bytes(secret)
        self._channel: Channel | None = None
        self._info: ServerInfo | None = None
        self._params_buf: bytearray | None = None
        self._params: torch.Tensor | None = None
        self._ever_connected = False

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> PSClient:
        self.connect()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is not None and not isinstance(exc, PSError):
            self.fail(f"{type(exc).__name__}: {exc}")
        self.close()

    @property
    def info(self) -> ServerInfo | None:
        """The WELCOME of the current connection, or None when not connected."""
        return self._info

    def connect(self) -> ServerInfo:
        """Connect and authenticate (CHALLENGE -> AUTH -> WELCOME). Idempotent while connected."""
        return self._connect(self.timeout_s)

    def _connect(self, timeout_s: float) -> ServerInfo:
        if self._channel is not None and self._info is not None:
            return self._info
        self._ever_connected = True
        what = f"the handshake with the parameter server at {self.host}:{self.port}"
        deadline = deadline_after(timeout_s)
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout_s)
        except TimeoutError:
            raise PSTimeoutError(
                f"timed out after {timeout_s:g}s connecting to the parameter server at "
                f"{self.host}:{self.port} (rank {self.rank}); raise {TIMEOUT_KEY} or check that "
                "executors can reach the driver"
            ) from None
        except OSError as exc:
            raise PSError(f"rank {self.rank} cannot reach the parameter server at "
                          f"{self.host}:{self.port}: {exc}") from exc
        set_socket_options(sock)
        channel = Channel(sock, max_elements=0)
        try:
            header = channel.recv_header(deadline)
            if header.type is MsgType.ERROR:
                raise AuthenticationError(self._error_text(channel, header, deadline))
            if header.type is not MsgType.CHALLENGE:
                raise ProtocolError(f"expected CHALLENGE, got {header.type.name}")
            nonce = channel.recv_bytes(header, deadline)
            channel.send_bytes(MsgType.AUTH, auth_mac(self._secret, nonce, self.rank, self.generation),
                               generation=self.generation, rank=self.rank, timeout=timeout_s)
            header = channel.recv_header(deadline)
            if header.type is MsgType.ERROR:
                raise AuthenticationError(
                    f"parameter server refused rank {self.rank}: {self._error_text(channel, header, deadline)}"
                )
            if header.type is not MsgType.WELCOME:
                raise ProtocolError(f"expected WELCOME, got {header.type.name}")
            info = self._parse_welcome(channel.recv_json(header, deadline))
        except AuthenticationError:
            channel.close()
            raise
        except TimeoutError:
            channel.close()
            raise PSTimeoutError(self._timeout_text(what, timeout_s)) from None
        except PeerClosedError:
            channel.close()
            raise AuthenticationError(
                f"the parameter server at {self.host}:{self.port} closed the connection during the "
                f"handshake of rank {self.rank} (wrong secret, generation or rank?)"
            ) from None
        except (PSError, OSError) as exc:
            channel.close()
            raise AuthenticationError(f"handshake of rank {self.rank} failed: {exc}") from exc
        channel.max_elements = info.num_params
        self._channel = channel
        self._info = info
        if self._params_buf is None or len(self._params_buf) != info.num_params * 4:
            self._params_buf = bytearray(info.num_params * 4)
            self._params = None
        logger.info("rank %s connected to the parameter server at %s:%s (version %s)",
                    self.rank, self.host, self.port, info.version)
        return info

    def close(self) -> None:
        """Close the socket. Idempotent; never raises."""
        channel, self._channel, self._info = self._channel, None, None
        if channel is not None:
            channel.close()

    # -- requests --------------------------------------------------------------------------------
    def pull(self, min_version: int = 0) -> tuple[int, torch.Tensor]:
        """Wait until the server's version is >= ``min_version`` and return (version, params).

        The returned tensor is a view of this client's reusable receive buffer: it is overwritten
        by the next ``pull``, so copy it (e.g. into the model) before pulling again.
        """
        channel = self._require()
        what = f"parameters of version >= {min_version}"
        self._send(lambda: channel.send_empty(MsgType.PULL, generation=self.generation, rank=self.rank,
                                              step=min_version, timeout=self.timeout_s), what)
        wait_s = _pull_wait_s(self.timeout_s)
        header = self._expect(MsgType.PARAMS, what, wait_s)
        assert self._info is not None and self._params_buf is not None
        if header.count != self._info.num_params:
            self._drop()
            raise ProtocolError(f"PARAMS of {header.count} elements, expected {self._info.num_params}")
        try:
            channel.recv_into(header, self._params_buf, deadline_after(wait_s))
        except Exception as exc:
            self._drop()
            raise self._translate(exc, what, wait_s) from None
        if self._params is None:
            self._params = decode_tensor(self._params_buf, header)
        return header.step, self._params

    def push(self, step: int, grad: torch.Tensor) -> None:
        """Send this rank's gradient for ``step`` and wait for the server's ACK.

        ``grad`` must hold ``num_params`` values; non-fp32/non-contiguous/GPU tensors are converted
        (one copy), fp32 contiguous CPU tensors are sent from their own memory.
        """
        channel = self._require()
        assert self._info is not None
        flat = grad.detach().reshape(-1)
        if flat.numel() != self._info.num_params:
            raise PSError(f"rank {self.rank} pushed {flat.numel()} gradient values for step {step}, "
                          f"the server holds {self._info.num_params} parameters")
        if flat.dtype != torch.float32 or flat.device.type != "cpu" or not flat.is_contiguous():
            flat = flat.to(device="cpu", dtype=torch.float32).contiguous()
        what = f"the ACK of the gradient for step {step}"
        self._send(lambda: channel.send_tensor(MsgType.PUSH, flat, generation=self.generation,
                                               rank=self.rank, step=step, timeout=self.timeout_s), what)
        self._expect(MsgType.ACK, what, self.timeout_s)

    def report(self, metrics: dict[str, Any]) -> None:
        """Send a metrics dict (JSON, <= 1 MiB) to the driver's ``on_metrics`` and wait for ACK."""
        channel = self._require()
        what = "the ACK of a metrics report"
        self._send(lambda: channel.send_json(MsgType.METRICS, dict(metrics), generation=self.generation,
                                             rank=self.rank, timeout=self.timeout_s), what)
        self._expect(MsgType.ACK, what, self.timeout_s)

    def fail(self, error: str, log_tail: str = "") -> None:
        """Tell the server this rank failed, so its peers stop waiting at once. Best effort: never
        raises, connects first if this client never connected, waits a few seconds at most."""
        wait_s = min(self.timeout_s, _FAIL_TIMEOUT_S)
        try:
            if self._channel is None and not self._ever_connected:
                self._connect(wait_s)
            channel = self._require()
            body = {"error": str(error)[:_MAX_FAIL_ERROR_CHARS],
                    "log_tail": str(log_tail)[-_MAX_FAIL_LOG_CHARS:]}
            channel.send_json(MsgType.FAIL, body, generation=self.generation, rank=self.rank,
                              timeout=wait_s)
            self._expect(MsgType.ACK, "the ACK of a FAIL report", wait_s)
        except Exception as exc:  # best effort by contract
            logger.warning("rank %s could not report its failure to the parameter server: %s",
                           self.rank, exc)

    def finish(self) -> None:
        """Tell the server this rank is done (so its disconnect is not a failure), then close."""
        channel = self._require()
        what = "the ACK of FINISH"
        try:
            self._send(lambda: channel.send_empty(MsgType.FINISH, generation=self.generation,
                                                  rank=self.rank, timeout=self.timeout_s), what)
            self._expect(MsgType.ACK, what, self.timeout_s)
        finally:
            self.close()

    # -- helpers ---------------------------------------------------------------------------------
    def _require(self) -> Channel:
        if self._channel is None:
            raise PSError(f"rank {self.rank} is not connected to the parameter server (call connect())")
        return self._channel

    def _drop(self) -> None:
        """After a timeout or a broken frame the stream is out of sync: close it."""
        self.close()

    def _send(self, action: Any, what: str) -> None:
        try:
            action()
        except PSError:
            raise  # raised while encoding, before any byte went out: the stream is still in sync
        except Exception as exc:
            self._drop()
            raise self._translate(exc, f"sending the request for {what}", self.timeout_s) from None

    def _expect(self, msg_type: MsgType, what: str, wait_s: float) -> Header:
        """Read the reply header; an ERROR frame raises PSError/PSTimeoutError with the server text."""
        channel = self._require()
        deadline = deadline_after(wait_s)
        try:
            header = channel.recv_header(deadline)
            if header.type is MsgType.ERROR:
                body = channel.recv_json(header, deadline)
            elif header.type is not msg_type:
                raise ProtocolError(f"expected {msg_type.name} while waiting for {what}, "
                                    f"got {header.type.name}")
            else:
                return header
        except Exception as exc:
            self._drop()
            raise self._translate(exc, what, wait_s) from None
        text = str(body.get("error", "unspecified error"))
        if body.get("kind") == "timeout":
            raise PSTimeoutError(text)
        if body.get("kind") == "protocol":
            self._drop()
            raise ProtocolError(text)
        raise PSError(text)

    def _translate(self, exc: Exception, what: str, wait_s: float) -> PSError:
        if isinstance(exc, TimeoutError):
            return PSTimeoutError(self._timeout_text(what, wait_s))
        if isinstance(exc, PeerClosedError):
            return PSError(f"the parameter server at {self.host}:{self.port} closed the connection of "
                           f"rank {self.rank} while it waited for {what}")
        if isinstance(exc, PSError):
            return exc
        if isinstance(exc, OSError):
            return PSError(f"rank {self.rank} lost its connection to the parameter server at "
                           f"{self.host}:{self.port} while waiting for {what}: {exc}")
        return PSError(f"rank {self.rank}: unexpected error while waiting for {what}: {exc!r}")

    def _timeout_text(self, what: str, wait_s: float) -> str:
        return (f"rank {self.rank} timed out after {wait_s:g}s waiting for {what} from the parameter "
                f"server at {self.host}:{self.port}; raise {TIMEOUT_KEY} if the server is only slow")

    @staticmethod
    def _error_text(channel: Channel, header: Header, deadline: float | None) -> str:
        body = channel.recv_json(header, deadline)
        return str(body.get("error", "unspecified error"))

    @staticmethod
    def _parse_welcome(body: dict[str, Any]) -> ServerInfo:
        try:
            info = ServerInfo(int(body["num_params"]), int(body["version"]), int(body["world_size"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed WELCOME: {exc}") from None
        if info.num_params <= 0 or info.version < 0 or info.world_size <= 0:
            raise ProtocolError(f"implausible WELCOME: {info}")
        return info
