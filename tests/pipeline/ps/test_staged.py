"""StagedParameterServer: one PS per pipeline stage behind the single-server driver API."""
import pytest
import torch

from pipeline.errors import PSError, WorkerFailure
from pipeline.ps import OptimizerSpec, PSSettings, new_secret
from pipeline.ps.staged import StagedParameterServer
from pipeline.wire.deadline import STEP_KEY, Timeout


def _server(stages=((0, 4), (4, 10)), replicas=2):
    initial = torch.arange(10, dtype=torch.float32)
    settings = PSSettings(optimizer=OptimizerSpec(lr=0.1), step_timeout=Timeout.of(5, STEP_KEY))
    return StagedParameterServer(initial, list(stages), settings, replicas=replicas, secret=new_secret(),
                                 host="127.0.0.1")


def test_stage_slices_concatenate_to_the_whole_model_and_ranks_are_global():
    with _server() as server:
        assert torch.equal(server.parameters(), torch.arange(10, dtype=torch.float32))
        assert len(server.addresses) == 2 and server.addresses[0] != server.addresses[1]
        assert server.global_rank(stage=1, replica=1) == 3 and server.version == 0


def test_stage_ranges_must_tile_the_parameters():
    with pytest.raises(PSError, match="must tile"):
        _server(stages=((0, 4), (5, 10)))


def test_root_cause_is_the_first_own_failure_not_a_link_or_a_consequence():
    with _server() as server:
        stage0, stage1 = server._failure_sink(0), server._failure_sink(1)
        stage0(WorkerFailure(0, "StageLinkError: pipeline link of stage 0 broke in step 3: closed"), False)
        stage0(WorkerFailure(1, "rank 1 closed its connection, after rank(s) 0 had failed"), True)
        assert list(server.root_failures) == [0]  # only fallout so far: the first one is all there is
        stage1(WorkerFailure(0, "InjectedFault: injected failure on rank 1 at step 3"), False)
        assert list(server.root_failures) == [1]  # stage 1 of replica 0 = global rank 1
        assert "InjectedFault" in server.root_failures[1].error


def test_checkpoints_hold_every_stage_at_one_version():
    with _server() as server:
        state = server.state_dict()
        assert state["version"] == 0 and len(state["stages"]) == 2
        server.load_state_dict(state)
        skewed = {**state, "stages": [state["stages"][0], {**state["stages"][1], "version": 1}]}
        with pytest.raises(PSError, match="different versions"):
            server.load_state_dict(skewed)
        with pytest.raises(PSError, match="cut into stages"):
            server.load_state_dict({**state, "stage_ranges": [[0, 5], [5, 10]]})
