"""The worker loop against a real parameter server, ranks in threads (no Spark)."""
import dataclasses
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.errors import PSError
from pipeline.data import read_tensors
from pipeline.models import ModelSpec, build_model, flat_parameters, load_flat_parameters, loss_fn
from pipeline.ps import OptimizerSpec, ParameterServer, PSSettings, new_secret
from pipeline.ps.modes.consistency import Consistency, expected_version
from pipeline.wire.deadline import STEP_KEY, Timeout
from pipeline.worker import WorkerPlan, run
from pipeline.worker.loop import InjectedFault
from pipeline.worker.plan import Deadlines, FaultPlan, LoaderPlan
from pipeline.worker.validation import combine, part_rows


def _settings(optimizer, *, consistency=Consistency(), compression="none", shards=1) -> PSSettings:
    """The servers of these tests: a 10 s step deadline as a bare ps.timeout_s gives it."""
    return PSSettings(optimizer=optimizer, consistency=consistency, compression=compression, shards=shards,
                      step_timeout=Timeout.of(10, STEP_KEY))


def _shard(path, rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 4)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    features = pa.ListArray.from_arrays(pa.array(np.arange(0, rows * 4 + 1, 4, dtype=np.int32)),
                                        pa.array(x.reshape(-1)))
    pq.write_table(pa.table({"features": features, "label": y}), path)
    return str(path)


def _plans(tmp_path, world=2, epochs=3, steps=8, faults=None):
    spec = ModelSpec(kind="mlp", num_features=4, num_outputs=2, task="classification", hidden=(8,))
    validation = (_shard(tmp_path / "val.parquet", 32, 99),)
    return spec, [WorkerPlan(rank=r, world_size=world, generation=1,
                             train_files=(_shard(tmp_path / f"s{r}.parquet", 64, r),),
                             validation_files=validation, validation_rows=part_rows(32, r, world),
                             model=spec, features_field="features", label_field="label", epochs=epochs,
                             steps_per_epoch=steps, seed=0, loader=LoaderPlan(prefetch=2),
                             deadlines=Deadlines.all(10), faults=faults or FaultPlan())
                  for r in range(world)]


def _run_ranks(plans, server, secret):
    results, errors = {}, {}

    def target(plan):
        try:
            results[plan.rank] = run(plan, *server.address, secret)
        except Exception as exc:  # collected for the assertions
            errors[plan.rank] = exc

    threads = [threading.Thread(target=target, args=(p,)) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return results, errors


def test_two_ranks_train_in_lockstep_and_report_epochs(tmp_path):
    spec, plans = _plans(tmp_path)
    torch.manual_seed(0)
    initial = flat_parameters(build_model(spec))
    reports = []
    secret = new_secret()
    with ParameterServer(initial, _settings(OptimizerSpec(lr=0.1, momentum=0.9)), world_size=2, secret=secret,
                         host="127.0.0.1", on_metrics=lambda r, m: reports.append((r, m))) as server:
        results, errors = _run_ranks(plans, server, secret)
        assert errors == {}
        assert server.version == 3 * 8
        assert not torch.equal(server.parameters(), initial)
        server_parameters = server.parameters()
    assert {r.steps for r in results.values()} == {24}
    assert sum(r.samples for r in results.values()) == 3 * 128
    epochs = sorted((m["epoch"], r) for r, m in reports)
    assert epochs == [(e, r) for e in range(3) for r in (0, 1)]
    # Each rank evaluated its half of the validation split, every epoch; together the whole split.
    assert [m["val_rows"] for r, m in sorted(reports, key=lambda x: (x[1]["epoch"], x[0]))] == [16] * 6
    last = [m for r, m in reports if m["epoch"] == 2]
    model = build_model(spec)
    load_flat_parameters(model, server_parameters)
    x, y = read_tensors(plans[0].validation_files)
    with torch.no_grad():
        output = model.eval()(x)
    row = combine(last)
    assert row["val_loss"] == pytest.approx(float(loss_fn(spec)(output, y)), rel=1e-5)
    assert row["val_accuracy"] == int((output.argmax(dim=1) == y).sum()) / 32
    losses = [m["train_loss"] for r, m in sorted(reports, key=lambda x: x[1]["epoch"]) if r == 0]
    assert losses[-1] < losses[0]


def test_a_failing_rank_releases_its_peer_with_its_rank_named(tmp_path):
    spec, plans = _plans(tmp_path, faults=FaultPlan(fail_rank=0, fail_step=2))
    secret = new_secret()
    with ParameterServer(flat_parameters(build_model(spec)), _settings(OptimizerSpec()), world_size=2,
                         secret=secret, host="127.0.0.1") as server:
        results, errors = _run_ranks(plans, server, secret)
        assert isinstance(errors[0], InjectedFault)
        assert isinstance(errors[1], PSError) and "rank 0" in str(errors[1])
        assert list(server.root_failures) == [0]
        # rank 1 dropped out after, as a consequence; the server notices its close asynchronously
        deadline = time.monotonic() + 10
        while sorted(server.failures) != [0, 1] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(server.failures) == [0, 1]
        assert server.version == 2


def _train_mode(tmp_path, consistency, *, compression="none", faults=None, epochs=3, shards=1,
                optimizer=OptimizerSpec(lr=0.1, momentum=0.9)):
    spec, plans = _plans(tmp_path, epochs=epochs, faults=faults)
    plans = [dataclasses.replace(p, optimizer=optimizer) for p in plans]
    torch.manual_seed(0)
    initial = flat_parameters(build_model(spec))
    reports = []
    secret = new_secret()
    settings = _settings(optimizer, consistency=consistency, compression=compression, shards=shards)
    with ParameterServer(initial, settings, world_size=2, secret=secret, host="127.0.0.1",
                         on_metrics=lambda r, m: reports.append((r, m))) as server:
        results, errors = _run_ranks(plans, server, secret)
        assert errors == {}
        return spec, initial, server.parameters(), server.version, server.stats, reports


def test_sync_gives_the_parameters_of_single_process_sgd_on_the_global_batches(tmp_path):
    from pipeline.models import load_flat_parameters, loss_fn
    from pipeline.worker.loop import make_train_loader

    spec, initial, params, version, _, _ = _train_mode(tmp_path, Consistency("sync"))
    assert version == 3 * 8
    model = build_model(spec)
    load_flat_parameters(model, initial)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = loss_fn("classification")
    # replay exactly the batches the workers drew, through the same loader the worker uses
    loaders = [make_train_loader(plan) for plan in _plans(tmp_path)[1]]
    for epoch in range(3):
        for batches in zip(*(loader.epoch(epoch) for loader in loaders)):
            opt.zero_grad()
            # the PS averages per-rank mean gradients: the mean of the per-rank mean losses
            (sum(loss(model(x), y) for x, y in batches) / 2).backward()
            opt.step()
    assert torch.allclose(params, flat_parameters(model), atol=1e-5)


@pytest.mark.parametrize("mode", ["async", "ssp", "average"])
def test_every_mode_trains_through_the_same_loop(tmp_path, mode):
    consistency = Consistency(mode, staleness=1, sync_every=3)
    # Momentum 0.5, not 0.9: async applies each rank's gradient alone on parameters up to a step stale, and
    # with an effective step of lr / (1 - 0.9) = 1.0 about one run in ten ended above its initial loss.
    spec, initial, params, version, stats, reports = _train_mode(tmp_path, consistency,
                                                                 optimizer=OptimizerSpec(lr=0.1, momentum=0.5))
    assert version == expected_version(consistency, 3 * 8, 2)
    assert not torch.equal(params, initial)
    assert stats["mode"] == mode
    assert sorted((m["epoch"], r) for r, m in reports) == [(e, r) for e in range(3) for r in (0, 1)]
    assert all({"wait_s", "staleness_max", "staleness_mean"} <= set(m) for _, m in reports)
    # learned: the final parameters fit all training rows better than the initial ones (judged on the
    # whole data set, not on per-epoch running losses, which async arrival order makes noisy)
    from pipeline.data import read_tensors
    from pipeline.models import load_flat_parameters, loss_fn

    x, y = read_tensors([str(tmp_path / f"s{r}.parquet") for r in range(2)])
    model = build_model(spec)

    def data_loss(flat):
        load_flat_parameters(model, flat)
        with torch.no_grad():
            return loss_fn("classification")(model(x), y).item()

    assert data_loss(params) < data_loss(initial)


def test_ssp_with_a_slow_rank_keeps_the_fast_one_within_the_bound(tmp_path):
    consistency = Consistency("ssp", staleness=2)
    *_, version, stats, reports = _train_mode(tmp_path, consistency, faults=FaultPlan(slow_rank=1, slow_s=0.02),
                                              epochs=2)
    assert version == 2 * 8
    assert max(m["staleness_max"] for _, m in reports) <= 2
    assert stats["blocked_pulls"] > 0 and 0 in stats["pull_wait_s_by_rank"]  # the fast rank waited


def test_ssp_with_zero_staleness_trains_exactly_like_sync(tmp_path):
    sync = _train_mode(tmp_path, Consistency("sync"))[2]
    ssp = _train_mode(tmp_path, Consistency("ssp", staleness=0))[2]
    assert torch.equal(sync, ssp)


# -- ps.shards -------------------------------------------------------------------------------------
def test_sync_with_two_shards_gives_exactly_the_parameters_of_one_shard(tmp_path):
    one = _train_mode(tmp_path, Consistency("sync"), shards=1)
    two = _train_mode(tmp_path, Consistency("sync"), shards=2)
    assert one[3] == two[3] == 3 * 8
    assert two[4]["shards"] == 2
    assert torch.equal(one[2], two[2])  # bit for bit: elementwise SGD per slice, same sums


@pytest.mark.parametrize("mode,compression", [("async", "none"), ("ssp", "fp16"), ("average", "bf16"),
                                              ("sync", "topk")])
def test_every_mode_and_compression_trains_with_three_shards(tmp_path, mode, compression):
    consistency = Consistency(mode, staleness=1, sync_every=3)
    spec, initial, params, version, stats, reports = _train_mode(tmp_path, consistency, compression=compression,
                                                                 shards=3)
    assert version == expected_version(consistency, 3 * 8, 2)
    assert [s["pushes_applied"] for s in stats["by_shard"]] == [stats["pushes_applied"]] * 3
    assert stats["push_payload_bytes"] > 0 and not torch.equal(params, initial)
    assert sorted((m["epoch"], r) for r, m in reports) == [(e, r) for e in range(3) for r in (0, 1)]


def test_a_failing_rank_is_named_with_two_shards(tmp_path):
    spec, plans = _plans(tmp_path, faults=FaultPlan(fail_rank=1, fail_step=3))
    secret = new_secret()
    with ParameterServer(flat_parameters(build_model(spec)), _settings(OptimizerSpec(), shards=2), world_size=2,
                         secret=secret, host="127.0.0.1") as server:
        results, errors = _run_ranks(plans, server, secret)
        assert isinstance(errors[1], InjectedFault)
        assert isinstance(errors[0], PSError) and "rank 1" in str(errors[0])
        assert list(server.root_failures) == [1]
        assert all(list(s.root_failures) == [1] for s in server._shards)  # one verdict on every shard
        assert server.version == 3
