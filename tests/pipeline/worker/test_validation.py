"""Every rank's part of the validation split, and the driver's sums: the whole split's figures."""
import pytest
import torch

from pipeline.models import ModelSpec, build_model, loss_fn
from pipeline.models.losses import LossSpec, loss_weight
from pipeline.worker import validation
from pipeline.worker.validation import combine, evaluate_part, part_rows

ROWS = 37


def test_parts_cover_the_split_once_in_order():
    for total, parts in ((37, 3), (8, 8), (3, 5), (0, 2), (100000, 7)):
        ranges = [part_rows(total, p, parts) for p in range(parts)]
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        sizes = [stop - start for start, stop in ranges]
        assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match=r"part 2 of 2"):
        part_rows(10, 2, 2)


def _case(task: str, loss: LossSpec, outputs: int):
    torch.manual_seed(0)
    spec = ModelSpec(kind="mlp", num_features=5, num_outputs=outputs, task=task, hidden=(8,), batch_norm=True,
                     dropout=0.3, loss=loss.to_dict())
    model = build_model(spec)
    model.train()
    x = {"numeric": torch.randn(ROWS, 5)}
    y = torch.randint(0, outputs, (ROWS,)) if task == "classification" else torch.randn(ROWS) * 3
    return spec, model, x, y


CASES = {
    "cross_entropy": ("classification", LossSpec(), 3),
    "weighted cross_entropy, smoothed": ("classification", LossSpec(class_weights=(0.2, 1.0, 5.0),
                                                                    label_smoothing=0.1), 3),
    "weighted bce": ("classification", LossSpec(kind="bce", class_weights=(0.5, 3.0)), 2),
    "mse": ("regression", LossSpec(), 1),
    "huber": ("regression", LossSpec(kind="huber", huber_delta=0.5), 1),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("parts", [1, 3, 5])
def test_parts_combine_to_the_whole_splits_loss_and_accuracy(name, parts, monkeypatch):
    task, loss, outputs = CASES[name]
    spec, model, x, y = _case(task, loss, outputs)
    monkeypatch.setattr(validation, "CHUNK_ROWS", 4)  # several chunks per part, one cut mid-part
    reports = []
    for part in range(parts):
        start, stop = part_rows(ROWS, part, parts)
        reports.append(evaluate_part(model, loss_fn(spec), loss_weight(spec),
                                     {k: v[start:stop] for k, v in x.items()}, y[start:stop], task))
    assert model.training  # left as training found it
    assert sum(r["val_rows"] for r in reports) == ROWS
    model.eval()
    with torch.no_grad():
        output = model(x)
        whole = float(loss_fn(spec)(output, y))
        accuracy = int((output.argmax(dim=1) == y).sum()) / len(y)
    row = combine(reports)
    assert row["val_loss"] == pytest.approx(whole, rel=1e-5)
    if task == "classification":
        assert row["val_accuracy"] == pytest.approx(accuracy, abs=1e-12)
    else:
        assert "val_accuracy" not in row


def test_weighted_cross_entropy_parts_weigh_by_their_class_weights_not_their_rows():
    # A part of only heavy-class rows must count for more than its row share: by rows, this is off.
    spec, model, x, y = _case(*CASES["weighted cross_entropy, smoothed"])
    y = torch.tensor([2] * 5 + [0] * (ROWS - 5))
    parts = [evaluate_part(model, loss_fn(spec), loss_weight(spec), {k: v[a:b] for k, v in x.items()}, y[a:b],
                           "classification") for a, b in ((0, 5), (5, ROWS))]
    model.eval()
    with torch.no_grad():
        whole = float(loss_fn(spec)(model(x), y))
    assert combine(parts)["val_loss"] == pytest.approx(whole, rel=1e-5)
    by_rows = sum(p["val_loss_sum"] / p["val_weight"] * p["val_rows"] for p in parts) / ROWS
    assert by_rows != pytest.approx(whole, rel=1e-3)


def test_ranks_without_a_part_are_left_out_and_no_parts_give_no_figures():
    assert combine([{"train_loss": 1.0}, {"train_loss": 2.0}]) == {}
    one = {"val_loss_sum": 3.0, "val_weight": 2.0, "val_rows": 2, "val_correct": 1}
    assert combine([one, {"train_loss": 1.0}]) == {"val_loss": 1.5, "val_rows": 2, "val_accuracy": 0.5}
