"""ps.overlap on real servers and clients: flat parameter/gradient views, gradient buckets pushed from
autograd hooks during backward, and the numbers they give against the non-overlapped step."""
import copy
import dataclasses
import threading

import pytest
import torch

from pipeline.errors import PSError
from pipeline.models import ModelSpec, build_model, flat_parameters
from pipeline.models.flat import flat_gradients
from pipeline.ps import OptimizerSpec, ParameterServer, PSClient, PSSettings, new_secret
from pipeline.ps.modes.consistency import Consistency, expected_version
from pipeline.wire.deadline import STEP_KEY, Timeout
from pipeline.worker import run
from pipeline.worker.buckets import FlatModel
from pipeline.worker.exchange import make_exchange
from pipeline.worker.plan import FaultPlan

from tests.pipeline.worker.test_loop import _plans, _run_ranks

SPEC = ModelSpec(kind="mlp", num_features=4, num_outputs=2, task="classification", hidden=(8, 8))
BUCKET = 64  # bytes: the 130 parameters of SPEC (520 bytes) are served in 9 slices


def _settings(consistency=Consistency(), compression="none", bucket_bytes=0, shards=1) -> PSSettings:
    return PSSettings(optimizer=OptimizerSpec(lr=0.1, momentum=0.9), consistency=consistency,
                      compression=compression, shards=shards, bucket_bytes=bucket_bytes,
                      step_timeout=Timeout.of(10, STEP_KEY))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 4, generator=g)
    return x, (x[:, 0] > x[:, 1]).long()


# -- FlatModel ---------------------------------------------------------------------------------------
def test_parameters_and_gradients_are_views_of_two_flat_buffers():
    torch.manual_seed(0)
    model = build_model(SPEC)
    twin = copy.deepcopy(model)
    flat = FlatModel(model)
    assert torch.equal(flat.params, flat_parameters(twin))
    x, y = _batch(0, 0)
    for _ in range(2):  # zeroing, not accumulating across steps
        flat.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
    twin.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(twin(x), y).backward()
    assert flat.intact()
    assert torch.equal(flat.grad, flat_gradients(twin))  # autograd accumulated into the flat buffer itself
    flat.params.zero_()  # what a PULL into the buffer does: the model sees it with no load step
    assert all(float(p.detach().abs().sum()) == 0.0 for p in model.parameters())


def test_a_replaced_gradient_is_copied_back_into_the_flat_buffer():
    model = build_model(SPEC)
    flat = FlatModel(model)
    first = next(model.parameters())
    first.grad = torch.full_like(first, 3.0)  # e.g. a user hook that assigns .grad
    assert not flat.intact()
    flat.rebind_grads()
    assert flat.intact() and float(flat.grad[:first.numel()].sum()) == 3.0 * first.numel()


def test_gradients_lie_in_a_given_buffer_of_the_right_size_and_in_their_own_otherwise():
    model = build_model(SPEC)
    total = sum(p.numel() for p in model.parameters())
    given = torch.full((total,), 7.0)
    flat = FlatModel(model, grad=given)
    assert flat.grad.data_ptr() == given.data_ptr() and float(given.abs().sum()) == 0.0  # zeroed
    assert next(model.parameters()).grad.data_ptr() == given.data_ptr()
    wrong = torch.zeros(total + 1)
    assert FlatModel(build_model(SPEC), grad=wrong).grad.data_ptr() != wrong.data_ptr()


def test_only_cpu_fp32_models_are_bound():
    assert FlatModel.bindable(build_model(SPEC))
    assert not FlatModel.bindable(build_model(SPEC).double())


# -- buckets on a real server, driven step by step ----------------------------------------------------
def _exchange_run(consistency, *, overlap: bool, bucket_bytes: int, compression="none", steps=6, slow=None):
    """Two ranks in threads, each the flat loop's calls around its own backward; returns the server's
    parameters, its stats, each rank's exchange stats and how many buckets left during backward."""
    torch.manual_seed(0)
    initial = flat_parameters(build_model(SPEC))
    secret = new_secret()
    out, errors = {}, {}
    with ParameterServer(initial, _settings(consistency, compression, bucket_bytes), world_size=2, secret=secret,
                         host="127.0.0.1") as server:
        def rank(r):
            try:
                with PSClient(*server.address, rank=r, secret=secret, timeout_s=10) as client:
                    torch.manual_seed(0)
                    model = build_model(SPEC)
                    ex = make_exchange(client, client.info, model, steps, OptimizerSpec(), flat=True, overlap=overlap)
                    step, taken = ex.begin(), []
                    while step < steps:
                        if slow == r:
                            threading.Event().wait(0.02)
                        x, y = _batch(r, step)
                        ex.zero_grad()
                        loss = torch.nn.functional.cross_entropy(model(x), y)
                        ex.before_backward(step)
                        loss.backward()
                        step = ex.after_backward(step)
                        taken.append(ex.stats.take())
                    client.finish()
                    out[r] = (taken, ex.pusher.early if ex.pusher else 0)
            except Exception as exc:  # collected for the assertion
                errors[r] = exc

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == {}
        return server.parameters(), server.stats, out


@pytest.mark.parametrize("compression", ["none", "fp16", "bf16", "topk"])
def test_sync_buckets_pushed_during_backward_give_the_non_overlapped_parameters(compression):
    bucketed, stats, out = _exchange_run(Consistency("sync"), overlap=True, bucket_bytes=BUCKET,
                                         compression=compression)
    assert stats["shards"] == 9
    assert all(early > 0 for _, early in out.values())  # buckets really left while backward ran
    # The server's work per update is every slice's (train.profile's ps/reduce_ms, ps/optimizer_ms).
    for key in ("time_reduce_s", "time_optimizer_s"):
        assert stats[key] == pytest.approx(sum(s[key] for s in stats["by_shard"]))
        assert stats[key] > stats["by_shard"][0][key]
    # The same slices pushed after backward: the only difference is when each bucket went out.
    same_slices, _, late = _exchange_run(Consistency("sync"), overlap=False, bucket_bytes=BUCKET,
                                         compression=compression)
    assert all(early == 0 for _, early in late.values())
    assert torch.allclose(bucketed, same_slices, rtol=0, atol=1e-6)
    if compression != "topk":  # elementwise encodings: slicing changes nothing against one whole push
        whole, one, _ = _exchange_run(Consistency("sync"), overlap=False, bucket_bytes=0, compression=compression)
        assert one["shards"] == 1
        assert torch.allclose(bucketed, whole, rtol=0, atol=1e-6)


def test_ssp_buckets_keep_the_staleness_bound_with_a_slow_rank():
    _, stats, out = _exchange_run(Consistency("ssp", staleness=1), overlap=True, bucket_bytes=BUCKET, slow=1,
                                  steps=10)
    assert all(early > 0 for _, early in out.values())
    assert max(t["staleness_max"] for taken, _ in out.values() for t in taken) <= 1
    assert stats["blocked_pulls"] > 0  # the fast rank was held back: the bound was exercised


def test_async_buckets_apply_every_push_and_report_the_staleness_seen():
    _, stats, out = _exchange_run(Consistency("async"), overlap=True, bucket_bytes=BUCKET, steps=8)
    assert all(early > 0 for _, early in out.values())
    assert [s["pushes_applied"] for s in stats["by_shard"]] == [16] * 9
    # Between a rank's pull and its push being applied only the other rank's 8 pushes can land.
    assert all(0 <= t["staleness_max"] <= 8 for taken, _ in out.values() for t in taken)


# -- the flat loop, end to end --------------------------------------------------------------------------
def _loop_run(tmp_path, consistency, *, overlap, bucket_bytes, compression="none", faults=None, epochs=2):
    _, plans = _plans(tmp_path, epochs=epochs, faults=faults)
    plans = [dataclasses.replace(p, model=SPEC, overlap=overlap, optimizer=OptimizerSpec(lr=0.1, momentum=0.9))
             for p in plans]
    torch.manual_seed(0)
    initial = flat_parameters(build_model(SPEC))
    secret = new_secret()
    reports = []
    with ParameterServer(initial, _settings(consistency, compression, bucket_bytes), world_size=2, secret=secret,
                         host="127.0.0.1", on_metrics=lambda r, m: reports.append(m)) as server:
        results, errors = _run_ranks(plans, server, secret)
        assert errors == {}
        return server.parameters(), server.version, reports


@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_the_loop_with_overlap_trains_exactly_like_one_whole_push(tmp_path, compression):
    on, version, _ = _loop_run(tmp_path, Consistency("sync"), overlap=True, bucket_bytes=BUCKET,
                               compression=compression)
    off, _, _ = _loop_run(tmp_path, Consistency("sync"), overlap=False, bucket_bytes=0, compression=compression)
    assert version == 2 * 8
    assert torch.allclose(on, off, rtol=0, atol=1e-6)


def test_the_loop_with_overlap_keeps_ssp_within_its_bound(tmp_path):
    consistency = Consistency("ssp", staleness=2)
    _, version, reports = _loop_run(tmp_path, consistency, overlap=True, bucket_bytes=BUCKET,
                                    faults=FaultPlan(slow_rank=1, slow_s=0.02))
    assert version == expected_version(consistency, 2 * 8, 2)
    assert max(m["staleness_max"] for m in reports) <= 2


# -- settings and client checks ---------------------------------------------------------------------
def test_bucket_size_sets_the_servers_slices_unless_shards_are_explicit():
    assert _settings(bucket_bytes=1 << 20).shards_for(1_126_410) == 5  # the 4.4 MB MLP of issue 17
    assert _settings(bucket_bytes=4).shards_for(10_000) == 64  # capped like ps.shards
    assert _settings(bucket_bytes=1 << 20, shards=3).shards_for(1_126_410) == 3
    assert _settings(bucket_bytes=0).shards_for(1_126_410) == 1
    with pytest.raises(PSError, match="ps.bucket_mb"):
        _settings(bucket_bytes=-1)


def test_config_turns_buckets_off_where_a_step_needs_the_whole_gradient():
    from pipeline.config import load
    from pipeline.launch.plans import bucket_bytes

    assert bucket_bytes(load("conf/digits.yaml", [])) == 0  # ps.overlap is off by default
    assert bucket_bytes(load("conf/digits.yaml", ["ps.overlap=true"])) == 1 << 20
    assert bucket_bytes(load("conf/digits.yaml", ["ps.overlap=true", "ps.bucket_mb=0.5"])) == 1 << 19
    assert bucket_bytes(load("conf/digits.yaml", ["ps.overlap=true", "train.clip_grad_norm=1.0"])) == 0
    with pytest.raises(Exception, match="bucket_mb"):
        load("conf/digits.yaml", ["ps.bucket_mb=0"])


def test_a_params_buffer_of_the_wrong_size_and_an_async_push_pull_slice_are_refused():
    torch.manual_seed(0)
    secret = new_secret()
    initial = flat_parameters(build_model(SPEC))
    with ParameterServer(initial, _settings(Consistency("async"), bucket_bytes=BUCKET), world_size=1,
                         secret=secret, host="127.0.0.1") as server:
        with PSClient(*server.address, rank=0, secret=secret, timeout_s=5) as client:
            with pytest.raises(PSError, match="contiguous fp32 CPU tensor of 130"):
                client.use_params_buffer(torch.zeros(10))
            with pytest.raises(PSError, match="not available in async"):
                client.send_slice(0, 0, torch.zeros(130), pull=True, first=True)
            assert client.link_ranges()[0] == (0, 15) and client.link_ranges()[-1][1] == 130
            client.finish()


def test_a_nan_loss_with_buckets_is_refused_by_every_slice_and_never_applied(tmp_path, monkeypatch, request):
    from pipeline.errors import NonFiniteError

    monkeypatch.syspath_prepend(str(request.path.parents[1] / "models"))  # user_models.nan_mlp
    spec = ModelSpec(kind="factory", num_features=4, num_outputs=2, task="classification",
                     factory="user_models:nan_mlp")
    _, plans = _plans(tmp_path, epochs=1)
    plans = [dataclasses.replace(p, model=spec, validation_files=(), overlap=True) for p in plans]
    initial = flat_parameters(build_model(spec))
    secret = new_secret()
    with ParameterServer(initial, _settings(bucket_bytes=8), world_size=2, secret=secret,
                         host="127.0.0.1") as server:
        _, errors = _run_ranks(plans, server, secret)
        assert server.stats["shards"] == 5
        assert server.version == 0 and torch.equal(server.parameters(), initial)
    assert any(isinstance(e, NonFiniteError) for e in errors.values()), errors
    assert all(isinstance(e, PSError) for e in errors.values()), errors  # NonFiniteError is a PSError


def test_a_model_that_renormalizes_its_embedding_copies_pulls_instead_of_binding_them():
    from pipeline.worker.buckets import writes_own_parameters

    plain = build_model(SPEC)
    renormed = torch.nn.Sequential(torch.nn.Embedding(10, 4, max_norm=1.0), torch.nn.Flatten(),
                                   torch.nn.Linear(4, 2))
    assert not writes_own_parameters(plain) and writes_own_parameters(renormed)
    with torch.no_grad():  # what a max_norm lookup does to the weight: it writes the rows it reads
        renormed(torch.tensor([[3]]))
    flat = FlatModel(renormed)
    assert not flat.binds and FlatModel(plain).binds
    from pipeline.worker.exchange import SyncExchange

    exchange = SyncExchange.__new__(SyncExchange)  # only _load's state: no server needed
    exchange.flat, exchange.model, exchange.lap = flat, renormed, lambda part: None
    pulled = torch.arange(flat.params.numel(), dtype=torch.float32)  # e.g. the server's read-only page
    own = flat.params.data_ptr()
    exchange._load(pulled)
    assert flat.params.data_ptr() == own and torch.equal(flat.params, pulled)  # copied, not bound
    assert all(own <= p.data_ptr() < own + 4 * pulled.numel() for p in renormed.parameters())
