"""Fixtures for the parameter-server tests: real servers on 127.0.0.1, real threads, short deadlines."""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

import pytest
import torch

from pipeline.errors import WorkerFailure
from pipeline.ps import OptimizerSpec, ParameterServer, PSClient, PSSettings, new_secret
from pipeline.ps.modes.consistency import Consistency
from pipeline.wire.deadline import STEP_KEY, Timeout

HOST = "127.0.0.1"
TIMEOUT_S = 1.5  # default deadline of servers and clients in these tests (<= 2 s)



@pytest.fixture
def secret() -> bytes:
    return new_secret()


def build_server(initial: torch.Tensor, *, world_size: int, secret: bytes, host: str = HOST,
                 optimizer: OptimizerSpec | None = None, timeout_s: float = TIMEOUT_S,
                 consistency: Consistency | None = None, compression: str = "none", topk_ratio: float = 0.01,
                 shards: int = 1, port: int = 0, generation: int = 1,
                 on_metrics: Callable[[int, dict], None] | None = None,
                 on_failure: Callable[[WorkerFailure, bool], None] | None = None,
                 buffers: Any = None, tls: Any = None, server_processes: bool = False,
                 shared_memory_bytes: int | None = None, server_threads: int = 1) -> ParameterServer:
    """An (unstarted) server from the flat keywords these tests speak: ``timeout_s`` is the step
    deadline as a bare ``ps.timeout_s`` would give it (``timeouts.step_s`` unset)."""
    settings = PSSettings(optimizer=optimizer or OptimizerSpec(name="sgd", lr=1.0),
                          consistency=consistency or Consistency(), compression=compression,
                          topk_ratio=topk_ratio, shards=shards, step_timeout=Timeout.of(timeout_s, STEP_KEY),
                          server_processes=server_processes, server_threads=server_threads,
                          **({} if shared_memory_bytes is None else {"shared_memory_bytes": shared_memory_bytes}))
    return ParameterServer(initial, settings, world_size=world_size, secret=secret, host=host, port=port,
                           generation=generation, on_metrics=on_metrics, on_failure=on_failure, buffers=buffers,
                           tls=tls)


@pytest.fixture
def server_factory() -> Callable[..., ParameterServer]:
    """``build_server`` as a fixture, for tests that construct servers themselves."""
    return build_server


@pytest.fixture
def make_server(secret: bytes) -> Iterator[Callable[..., ParameterServer]]:
    """Factory of started servers (keywords of ``build_server``), all closed at teardown."""
    servers: list[ParameterServer] = []

    def make(initial: torch.Tensor | None = None, *, world_size: int = 2, **options: Any) -> ParameterServer:
        options.setdefault("secret", secret)
        server = build_server(torch.arange(6, dtype=torch.float32) if initial is None else initial,
                              world_size=world_size, **options).start()
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
