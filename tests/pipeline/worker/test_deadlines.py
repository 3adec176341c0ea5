"""Each wait of a worker is its plan's Deadline and its error names that key: the PS handshake and a
stage link's accept timeouts.connect_s, the allreduce rendezvous too."""
import socket

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.errors import PSTimeoutError
from pipeline.models import ModelSpec, build_model, flat_parameters
from pipeline.parallel.link import StageListener
from pipeline.parallel.stages import split_stages, stage_slices
from pipeline.ps import OptimizerSpec, PSSettings, new_secret
from pipeline.ps.server.staged import StagedParameterServer
from pipeline.wire.deadline import CONNECT_KEY, LINK_KEY, STEP_KEY, Timeout
from pipeline.worker import WorkerPlan, run
from pipeline.worker.distributed import Rendezvous, process_group
from pipeline.worker.plan import Deadlines, StagePlan
from pipeline.worker.stage_loop import StageLinkError, StageWiring

SPEC = ModelSpec(kind="mlp", num_features=4, num_outputs=2, task="classification", hidden=(8,))
# Everything waits long except connecting, so a test that times out can only be timing out there.
SHORT_CONNECT = Deadlines(step=Timeout(30.0, STEP_KEY), connect=Timeout(0.5, CONNECT_KEY), link=Timeout(30.0, LINK_KEY))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shard(path, rows=16):
    x = np.random.default_rng(0).normal(size=(rows, 4)).astype(np.float32)
    features = pa.ListArray.from_arrays(pa.array(np.arange(0, rows * 4 + 1, 4, dtype=np.int32)),
                                        pa.array(x.reshape(-1)))
    pq.write_table(pa.table({"features": features, "label": (x[:, 0] > 0).astype(np.int64)}), path)
    return str(path)


def _plan(train_files=(), stage=None, rank=0, world=1):
    return WorkerPlan(rank=rank, world_size=world, generation=1, train_files=tuple(train_files),
                      validation_files=(), model=SPEC, features_field="features", label_field="label", epochs=1,
                      steps_per_epoch=2, seed=0, stage=stage, deadlines=SHORT_CONNECT)


def test_a_parameter_server_that_never_answers_times_out_naming_timeouts_connect_s():
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never speaks
        with pytest.raises(PSTimeoutError) as caught:
            run(_plan(), *silent.getsockname(), new_secret())
    assert "0.5s" in str(caught.value) and "raise timeouts.connect_s" in str(caught.value)


def test_a_previous_stage_that_never_connects_times_out_naming_timeouts_connect_s(tmp_path):
    torch.manual_seed(0)
    model = build_model(SPEC)
    secret = new_secret()
    settings = PSSettings(optimizer=OptimizerSpec(), step_timeout=Timeout(30.0, STEP_KEY))
    listener = StageListener("127.0.0.1", secret, 1, stage=1, rank=1, expect_rank=0, timeout_s=30)
    plan = _plan((_shard(tmp_path / "s.parquet"),), StagePlan(stage=1, stages=2, replica=0, replicas=1), rank=1,
                 world=2)
    with StagedParameterServer(flat_parameters(model), stage_slices(split_stages(model, 2)), settings, replicas=1,
                               secret=secret, host="127.0.0.1") as server:
        with pytest.raises(StageLinkError) as caught:  # stage 0 never runs
            run(plan, *server.addresses[1], secret, wiring=StageWiring(listener, None))
    assert "stage 1" in str(caught.value) and "raise timeouts.connect_s" in str(caught.value)


def test_a_bare_number_is_timeouts_connect_s_following_ps_timeout_s_and_a_timeout_is_kept():
    assert Rendezvous("h", 1, 5).timeout == Timeout(5.0, CONNECT_KEY, "ps.timeout_s")
    own = Timeout(7.0, CONNECT_KEY)
    assert Rendezvous("h", 1, own).timeout is own


def test_a_rendezvous_no_peer_joins_fails_naming_timeouts_connect_s():
    from pipeline.worker.store import StoreServer

    secret = new_secret()
    server = StoreServer("127.0.0.1", secret, 1)
    port = server.address[1]
    try:
        with pytest.raises(RuntimeError) as caught:
            with process_group(Rendezvous("127.0.0.1", port, Timeout(1.0, CONNECT_KEY), secret=secret, generation=1),
                               0, 2, "cpu"):
                pass
    finally:
        server.close()
    text = str(caught.value)
    assert "rank 0" in text and f"127.0.0.1:{port}" in text and "2 ranks" in text
    assert "raise timeouts.connect_s" in text
