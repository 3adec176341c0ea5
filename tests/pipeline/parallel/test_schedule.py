"""GPipe steps over real links reproduce single-process training (the acceptance of pipeline parallelism)."""
import copy
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.errors import ConfigError, PSError
from pipeline.models import flat_parameters
from pipeline.parallel import GPipeStage, StageListener, StageStats, bubble_fraction, connect_link, split_rows
from pipeline.parallel.stages import split_stages

SECRET = b"pipeline-test-secret"
GEN = 1
LR = 0.1
STEPS = 5


def mlp():
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16),
                         nn.ReLU(), nn.Linear(16, 3))


def batches(rows, steps=STEPS):
    gen = torch.Generator().manual_seed(99)
    return [(torch.randn(rows, 8, generator=gen), torch.randint(0, 3, (rows,), generator=gen))
            for _ in range(steps)]


def reference(model, data, momentum):
    """Single-process training on the global batch: the mean-loss gradient, then SGD."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return flat_parameters(model), losses


def pipelined(model, data, *, stages, replicas=1, micro_batches=4, momentum=0.0):
    """Train ``replicas`` copies of ``model``, each cut into ``stages`` stages running in their own threads
    and linked over 127.0.0.1. Each replica trains on its contiguous share of every global batch; each
    stage's gradient is averaged over the replicas (the parameter server's job in production) before its
    own SGD step. Returns (per-replica reassembled flat parameters, last-stage losses of replica 0,
    per-(replica, stage) cumulative stats)."""
    parts = [split_stages(copy.deepcopy(model), stages) for _ in range(replicas)]
    listeners = [[None] + [StageListener("127.0.0.1", SECRET, GEN, stage=p, rank=r * stages + p,
                                         expect_rank=r * stages + p - 1, timeout_s=20)
                           for p in range(1, stages)] for r in range(replicas)]
    barriers = [threading.Barrier(replicas) for _ in range(stages)]
    shared = [[None] * replicas for _ in range(stages)]
    losses, stats, errors = [], {}, []

    def run(r, p):
        prev = nxt = None
        try:
            if p > 0:
                prev = listeners[r][p].accept()
            if p < stages - 1:
                host, port = listeners[r][p + 1].address
                nxt = connect_link(host, port, SECRET, GEN, stage=p, rank=r * stages + p,
                                   expect_rank=r * stages + p + 1, timeout_s=20)
            module = parts[r][p]
            stage = GPipeStage(module, stage=p, stages=stages, micro_batches=micro_batches, prev=prev, next=nxt,
                               loss_fn=F.cross_entropy if p == stages - 1 else None)
            opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=momentum)
            for step, (x, y) in enumerate(data):
                share = x.shape[0] // replicas
                rows = slice(r * share, (r + 1) * share)
                opt.zero_grad()
                result = stage.step(step, features=x[rows] if p == 0 else None,
                                    labels=y[rows] if p == stages - 1 else None)
                if r == 0 and p == stages - 1:
                    losses.append(result.loss)
                if replicas > 1:
                    shared[p][r] = [q.grad.clone() for q in module.parameters()]
                    barriers[p].wait(30)
                    for i, q in enumerate(module.parameters()):
                        q.grad = torch.stack([shared[p][o][i] for o in range(replicas)]).mean(0)
                    barriers[p].wait(30)  # nobody overwrites ``shared`` while another replica reads it
                opt.step()
            stats[(r, p)] = stage.take()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            for barrier in barriers:
                barrier.abort()
        finally:
            for link in (prev, nxt):
                if link is not None:
                    link.close()

    threads = [threading.Thread(target=run, args=(r, p), daemon=True)
               for r in range(replicas) for p in range(stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for row in listeners:
        for listener in row[1:]:
            listener.close()
    assert not any(t.is_alive() for t in threads), "a stage thread hung"
    if errors:
        raise errors[0]
    flats = [torch.cat([flat_parameters(m) for m in parts[r]]) for r in range(replicas)]
    return flats, losses, stats


@pytest.mark.parametrize("stages, rows, momentum", [(2, 32, 0.0), (3, 30, 0.0), (2, 32, 0.9), (3, 30, 0.9)])
def test_pipeline_training_matches_single_process(stages, rows, momentum):
    model, data = mlp(), batches(rows)  # 30 rows: micro-batches of 8, 8, 7, 7 exercise the loss scaling
    expected, expected_losses = reference(model, data, momentum)
    (got,), losses, stats = pipelined(model, data, stages=stages, micro_batches=4, momentum=momentum)
    assert (got - expected).abs().max().item() <= 1e-5
    assert losses == pytest.approx(expected_losses, abs=1e-5)
    assert (got - flat_parameters(model)).abs().max().item() > 1e-3  # it did train
    for p in range(stages):
        s = stats[(0, p)]
        assert s.steps == STEPS and s.rows == STEPS * rows
        assert s.compute_s > 0 and 0 <= s.bubble_fraction < 1
        assert (s.loss is not None) == (p == stages - 1)
        # Each micro-batch sends one frame per link direction: activations forward, gradients back.
        frames = (p > 0) + (p < stages - 1)
        assert s.bytes_sent > frames * STEPS * 4 * 48


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_two_replicas_of_a_two_stage_pipeline_match_single_process(momentum):
    model, data = mlp(), batches(32)
    expected, _ = reference(model, data, momentum)
    flats, _, _ = pipelined(model, data, stages=2, replicas=2, micro_batches=4, momentum=momentum)
    for got in flats:
        assert (got - expected).abs().max().item() <= 1e-5


def test_a_single_stage_accumulates_micro_batches_to_the_full_batch_gradient():
    model, (x, y) = mlp(), batches(10, 1)[0]
    whole = copy.deepcopy(model)
    F.cross_entropy(whole(x), y).backward()
    stage = GPipeStage(model, stage=0, stages=1, micro_batches=3, loss_fn=F.cross_entropy)
    stats = stage.step(0, features=x, labels=y)
    for a, b in zip(model.parameters(), whole.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)
    assert stats.loss == pytest.approx(F.cross_entropy(whole(x), y).item(), abs=1e-6)
    assert stats.bytes_sent == 0 and stats.idle_s == 0


def test_more_micro_batches_than_rows_is_refused():
    model, (x, y) = mlp(), batches(3, 1)[0]
    stage = GPipeStage(model, stage=0, stages=1, micro_batches=4, loss_fn=F.cross_entropy)
    with pytest.raises(ConfigError, match=r"parallelism.micro_batches is 4 but the batch has only 3 row"):
        stage.step(0, features=x, labels=y)


def test_split_rows_is_array_split():
    assert split_rows(10, 4) == [3, 3, 2, 2]
    assert split_rows(8, 4) == [2, 2, 2, 2]
    assert split_rows(5, 5) == [1] * 5
    with pytest.raises(ConfigError, match="parallelism.micro_batches must be >= 1"):
        split_rows(5, 0)


def test_take_returns_the_totals_and_starts_afresh():
    model, data = mlp(), batches(8, 2)
    stage = GPipeStage(model, stage=0, stages=1, micro_batches=2, loss_fn=F.cross_entropy)
    first = stage.step(0, features=data[0][0], labels=data[0][1])
    second = stage.step(1, features=data[1][0], labels=data[1][1])
    total = stage.take()
    assert total.steps == 2 and total.rows == 16
    assert total.loss == pytest.approx(first.loss + second.loss)
    assert total.mean_loss == pytest.approx((first.loss + second.loss) / 2)
    assert total.compute_s == pytest.approx(first.compute_s + second.compute_s)
    assert stage.take() == StageStats()


def test_bubble_fraction():
    assert bubble_fraction(1.0, 3.0) == 0.25
    assert bubble_fraction(0.0, 0.0) == 0.0
    assert StageStats(idle_s=3.0, compute_s=1.0).bubble_fraction == 0.75


def test_stage_wiring_is_checked():
    model = mlp()
    with pytest.raises(ValueError, match="the last stage needs a loss_fn"):
        GPipeStage(model, stage=0, stages=1, micro_batches=1)
    with pytest.raises(ValueError, match="stage 0 needs a link to the next stage"):
        GPipeStage(model, stage=0, stages=2, micro_batches=1)
    with pytest.raises(ConfigError, match="parallelism.micro_batches must be an integer >= 1"):
        GPipeStage(model, stage=0, stages=1, micro_batches=0, loss_fn=F.cross_entropy)


def test_a_failing_stage_closes_its_links_so_its_neighbour_fails_at_once():
    model, (x, y) = mlp(), batches(8, 1)[0]
    first, last = split_stages(model, 2)
    with StageListener("127.0.0.1", SECRET, GEN, stage=1, rank=1, timeout_s=20) as listener:
        errors = {}

        def run_last():
            down = listener.accept()
            stage = GPipeStage(last, stage=1, stages=2, micro_batches=4, prev=down, loss_fn=F.cross_entropy)
            try:
                stage.step(0, labels=torch.full((8,), 7))  # class 7 of 3: the loss raises
            except Exception as exc:
                errors["last"] = exc
            assert down.closed

        thread = threading.Thread(target=run_last, daemon=True)
        thread.start()
        up = connect_link(*listener.address, SECRET, GEN, stage=0, rank=0, timeout_s=20)
        stage = GPipeStage(first, stage=0, stages=2, micro_batches=4, next=up)
        with pytest.raises(PSError, match=r"stage 1 \(rank 1\) closed the link while stage 0"):
            stage.step(0, features=x)
        thread.join(30)
    assert isinstance(errors.get("last"), (IndexError, RuntimeError))
