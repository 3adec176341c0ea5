"""The driver <-> shard-process pipe's codec: data only, round trips every message the proxy sends."""
from __future__ import annotations

import json
import os

import pytest
import torch

from pipeline.errors import WorkerFailure
from pipeline.ps import OptimizerSpec, PSSettings
from pipeline.ps.transport.connection import ShardAddress
from pipeline.ps.processes.codec import decode, encode
from pipeline.ps.processes.control_pipe import Pipe


def test_state_dicts_settings_and_failures_round_trip_exactly():
    state = {"version": 7, "params": torch.randn(5), "optimizer": {"state": {0: {"momentum_buffer": torch.ones(5),
                                                                                "step": torch.tensor(3.0)}},
                                                                 "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99),
                                                                                   "params": [0], "foreach": None}]},
             "clocks": {1: 4}, "ranks": {0, 2}, "nan": float("inf"), "raw": b"\x00\xffsecret",
             "failure": WorkerFailure(1, "boom", "tail", False), "layout": [ShardAddress("h", 1, 0, 5)],
             "settings": PSSettings(optimizer=OptimizerSpec(name="adam", lr=0.01))}
    back = decode([bytes(f) for f in encode(state)])
    assert torch.equal(back["params"], state["params"]) and back["params"].dtype == torch.float32
    assert torch.equal(back["optimizer"]["state"][0]["step"], torch.tensor(3.0))
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert back["clocks"] == {1: 4} and back["ranks"] == {0, 2} and back["nan"] == float("inf")
    assert back["raw"] == state["raw"] and back["failure"] == state["failure"]
    assert back["layout"] == state["layout"] and back["settings"] == state["settings"]


def test_only_the_listed_dataclasses_are_rebuilt_and_anything_else_is_refused():
    class Other:
        pass

    with pytest.raises(TypeError, match="cannot carry a Other"):
        encode({"x": Other()})
    forged = json.dumps({"$dc": "Popen", "f": {"args": ["sh"]}}).encode()
    with pytest.raises(ValueError, match="does not carry 'Popen'"):
        decode([forged])
    with pytest.raises(ValueError, match="unknown tensor dtype"):
        decode([json.dumps({"$t": 0, "dtype": "__class__", "shape": [0]}).encode(), b""])


def test_a_pipe_carries_whole_messages():
    r, w = os.pipe()
    reader, writer = Pipe(r, readable=True), Pipe(w, readable=False)
    try:
        writer.send(("call", ("load_state_dict", {"params": torch.arange(4.0)})))
        assert reader.poll(5)
        op, (name, state) = reader.recv()
        assert (op, name) == ("call", "load_state_dict") and torch.equal(state["params"], torch.arange(4.0))
    finally:
        reader.close()
        writer.close()
