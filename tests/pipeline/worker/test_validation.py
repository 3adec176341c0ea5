"""Every rank's part of the validation split, and the driver's sums: the whole split's figures."""
import gc
import weakref

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.data import read_tensors
from pipeline.data.arrow_read import read_row_group

from pipeline.models import ModelSpec, build_model, loss_fn
from pipeline.models.losses import LossSpec, loss_weight
from pipeline.worker import validation
from pipeline.worker.validation import ValidationPart, combine, evaluate_part, part_rows

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
                                     [({k: v[start:stop] for k, v in x.items()}, y[start:stop])], task))
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
    parts = [evaluate_part(model, loss_fn(spec), loss_weight(spec), [({k: v[a:b] for k, v in x.items()}, y[a:b])],
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


# A validation split as the ETL writes it: two files of several row groups (GROUP rows each, the last short).
GROUP, FILE_ROWS = 50, (230, 170)


def _shards(tmp_path, width=5, classes=3):
    rng = np.random.default_rng(7)
    files = []
    for i, rows in enumerate(FILE_ROWS):
        table = pa.table({"features": pa.array(list(rng.standard_normal((rows, width)).astype(np.float32)),
                                               pa.list_(pa.float32())),
                          "label": pa.array(rng.integers(0, classes, rows), pa.int64())})
        path = str(tmp_path / f"validation-{i}.parquet")
        pq.write_table(table, path, row_group_size=GROUP)
        files.append(path)
    return files


class CountingReader:
    """read_row_group, counting the row groups read and the most alive at once (their label arrays'
    lifetimes: a row group's tensors share its Arrow buffers, so its labels live as long as any of it)."""

    def __init__(self):
        self.read = self.alive = self.most_alive = 0

    def __call__(self, *args):
        x, y = read_row_group(*args)
        gc.collect()  # what was released is counted as gone before this one is counted in
        self.read += 1
        self.alive += 1
        self.most_alive = max(self.most_alive, self.alive)
        weakref.finalize(y, self._gone)
        return x, y

    def _gone(self):
        self.alive -= 1


def _part(files, rows, reader, cache_mb):
    return ValidationPart(files, rows, features_field="features", label_field="label", num_features=5,
                          features=None, device="cpu", cache_bytes=int(cache_mb * 2**20), read=reader)


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("cache_mb", [0, 64])
def test_streamed_parts_give_the_whole_parts_figures_every_epoch(tmp_path, parts, cache_mb, monkeypatch):
    spec, model, _, _ = _case(*CASES["weighted cross_entropy, smoothed"])
    files = _shards(tmp_path)
    monkeypatch.setattr(validation, "CHUNK_ROWS", 16)  # chunks cut inside row groups too
    whole = []
    for part in range(parts):
        rows = part_rows(sum(FILE_ROWS), part, parts)
        whole.append(evaluate_part(model, loss_fn(spec), loss_weight(spec),
                                   [read_tensors(files, num_features=5, rows=rows)], "classification"))
    for epoch in range(2):
        streamed = [evaluate_part(model, loss_fn(spec), loss_weight(spec),
                                  _part(files, part_rows(sum(FILE_ROWS), p, parts), None, cache_mb), "classification")
                    for p in range(parts)]
        for mine, theirs in zip(streamed, whole):
            assert mine["val_rows"] == theirs["val_rows"] and mine["val_correct"] == theirs["val_correct"]
            assert mine["val_loss_sum"] == pytest.approx(theirs["val_loss_sum"], rel=1e-6)
            assert mine["val_weight"] == pytest.approx(theirs["val_weight"], rel=1e-6)
        assert combine(streamed) == pytest.approx(combine(whole), rel=1e-6)


def test_a_part_over_the_cache_budget_holds_one_row_group_at_once_and_is_read_again_each_epoch(tmp_path):
    spec, model, _, _ = _case(*CASES["cross_entropy"])
    files = _shards(tmp_path)
    reader = CountingReader()
    part = _part(files, (20, 380), reader, cache_mb=0.001)  # ~1 kB: the 360-row part is ~10 kB
    for _ in range(3):
        report = evaluate_part(model, loss_fn(spec), loss_weight(spec), part, "classification")
        assert report["val_rows"] == 360
    assert part.cached is False
    # rows 20..380 touch row groups 0-4 of the first file (230 rows) and 0-2 of the second: 8 per epoch
    assert reader.read == 3 * 8
    assert reader.most_alive <= 2  # the one being evaluated, and the next while it is read


def test_a_part_within_the_cache_budget_is_read_once(tmp_path):
    spec, model, _, _ = _case(*CASES["cross_entropy"])
    reader = CountingReader()
    part = _part(_shards(tmp_path), None, reader, cache_mb=1)
    first = evaluate_part(model, loss_fn(spec), loss_weight(spec), part, "classification")
    second = evaluate_part(model, loss_fn(spec), loss_weight(spec), part, "classification")
    assert first == second and first["val_rows"] == sum(FILE_ROWS)
    assert part.cached is True and reader.read == 9
