"""StagedParameterServer: one PS per pipeline stage behind the single-server driver API."""
import pytest
import torch

from pipeline.errors import NonFiniteError, PSError, WorkerFailure
from pipeline.ps import OptimizerSpec, PSClient, PSSettings, new_secret
from pipeline.ps.server.staged import StagedParameterServer
from pipeline.wire.deadline import STEP_KEY, Timeout


def _server(stages=((0, 4), (4, 10)), replicas=2, secret=None):
    initial = torch.arange(10, dtype=torch.float32)
    settings = PSSettings(optimizer=OptimizerSpec(lr=0.1), step_timeout=Timeout.of(5, STEP_KEY))
    return StagedParameterServer(initial, list(stages), settings, replicas=replicas,
                                 secret=secret or new_secret(), host="127.0.0.1")


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


def test_a_remapped_failure_keeps_its_retryable_flag():
    with _server() as server:
        server._failure_sink(1)(WorkerFailure(1, "NonFiniteError: loss is nan", retryable=False), False)
        assert server.root_failures == {3: WorkerFailure(3, "NonFiniteError: loss is nan", retryable=False)}


def test_a_stage_workers_non_retryable_failure_reaches_the_driver_as_such():
    secret = new_secret()
    with _server(secret=secret) as server:
        host, port = server.addresses[1]
        with PSClient(host, port, rank=0, secret=secret, timeout_s=5) as client:  # stage 1 of replica 0
            client.report_failure(NonFiniteError("loss is nan at step 2"))
        assert server.root_failures[1].retryable is False
        assert server.failures[1].retryable is False
