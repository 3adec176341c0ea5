"""Fixtures for the parameter-server tests: real servers on 127.0.0.1, real threads, short deadlines."""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

import pytest
import torch

from pipeline.ps import OptimizerSpec, ParameterServer, PSClient, new_secret

HOST = "127.0.0.1"
TIMEOUT_S = 1.5  # default deadline of servers and clients in these tests (<= 2 s)



@pytest.fixture
def secret() -> bytes:
    return new_secret()


@pytest.fixture
def make_server(secret: bytes) -> Iterator[Callable[..., ParameterServer]]:
    """Factory of started servers, all closed at teardown."""
    servers: list[ParameterServer] = []

    def make(initial: torch.Tensor | None = None, *, world_size: int = 2,
             optimizer: OptimizerSpec | None = None, **kwargs: Any) -> ParameterServer:
        kwargs.setdefault("timeout_s", TIMEOUT_S)
        kwargs.setdefault("secret", secret)
        server = ParameterServer(
            torch.arange(6, dtype=torch.float32) if initial is None else initial,
            world_size=world_size,
            optimizer=optimizer or OptimizerSpec(name="sgd", lr=1.0),
            host=HOST,
            **kwargs,
        ).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def make_client(secret: bytes) -> Iterator[Callable[..., PSClient]]:
    """Factory ``make_client(server, rank, **kwargs)`` of (unconnected) clients, closed at teardown."""
    clients: list[PSClient] = []

    def make(server: ParameterServer, rank: int, **kwargs: Any) -> PSClient:
        kwargs.setdefault("timeout_s", TIMEOUT_S)
        kwargs.setdefault("secret", secret)
        host, port = server.address
        c = PSClient(host, port, rank=rank, **kwargs)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


class Background:
    """One callable in a daemon thread: ``outcome()`` joins and returns its value or the exception it
    raised; ``result()`` returns the value and re-raises the exception."""

    JOIN_S = 20.0

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._out: list[Any] = []

        def target() -> None:
            try:
                self._out.append(fn())
            except BaseException as exc:  # noqa: BLE001 - handed back to the test
                self._out.append(exc)

        self._thread = threading.Thread(target=target, daemon=True)
        self._thread.start()

    def outcome(self) -> Any:
        self._thread.join(self.JOIN_S)
        assert not self._thread.is_alive(), "background call hung"
        return self._out[0]

    def result(self) -> Any:
        value = self.outcome()
        if isinstance(value, BaseException):
            raise value
        return value


@pytest.fixture
def background() -> Callable[[Callable[[], Any]], Background]:
    """Factory: ``background(fn)`` starts fn in a thread (see Background)."""
    return Background
