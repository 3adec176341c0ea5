"""Hostile input at the edges of the ETL: every case is a clear DataError (file, column, count, fix) or the
configured handling, and never partial output: a shard set already at the target stays byte-for-byte
intact (same manifest fingerprint, same files) and no staging folder is left behind."""
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import build
from pipeline.data import read_tensors
from pipeline.errors import DataError
from pipeline.etl import run_etl
from pipeline.etl.split import SPLIT_COLUMN, assign_split
from pipeline.shards import load_manifest, steps_per_epoch

pytestmark = pytest.mark.lts  # also run on the LTS stack

BATCH = 8  # 2 workers x 8 rows: every data set below but the too-small one has enough train rows


def _table(rows=120, seed=0, start=0, **columns):
    rng = np.random.default_rng(seed)
    data = {"id": np.arange(start, start + rows), "f1": rng.normal(5, 2, rows), "f2": rng.normal(-3, 0.5, rows),
            "label": np.where(rng.random(rows) > 0.5, "cat", "dog")}
    data.update(columns)
    return pa.table(data)


def _write_parts(folder: Path, tables) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, table in enumerate(tables):
        paths.append(folder / f"part-{i:05d}.parquet")
        pq.write_table(table, paths[-1])
    return paths


def _snapshot(target: Path) -> dict:
    return {str(p.relative_to(target)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(target.rglob("*")) if p.is_file()}


@dataclass
class Previous:
    """A good shard set committed before the hostile runs; every failing run targets it."""
    target: Path
    fingerprint: str
    files: dict

    def assert_untouched(self):
        assert load_manifest(self.target).fingerprint == self.fingerprint
        assert _snapshot(self.target) == self.files
        leftovers = [p.name for p in self.target.parent.iterdir() if p.name.startswith(".")]
        assert leftovers == [], leftovers  # no .<name>.staging-* / .retired-* folders


@pytest.fixture(scope="module")
def previous(spark, tmp_path_factory):
    root = tmp_path_factory.mktemp("previous")
    _write_parts(root / "in", [_table(120, seed=1)])
    target = root / "out" / "shards"
    manifest = run_etl(spark, build({
        "name": "good", "workdir": str(root / "work"), "parallelism": {"data": 2}, "train": {"batch_size": BATCH},
        "data": {"source": "parquet", "path": str(root / "in"), "id_column": "id", "shards_dir": str(target)}}))
    return Previous(target, manifest.fingerprint, _snapshot(target))


def _cfg(tmp_path, path, target=None, source="parquet", batch_size=BATCH, **data):
    data = {"source": source, "path": str(path), **data}
    if target is not None:
        data["shards_dir"] = str(target)
    return build({"name": "hostile", "workdir": str(tmp_path / "work"), "parallelism": {"data": 2},
                  "train": {"batch_size": batch_size}, "data": data})


def _fails(spark, cfg, previous, *patterns) -> str:
    """Run the ETL expecting a DataError whose message matches every pattern; the old set is intact."""
    with pytest.raises(DataError) as info:
        run_etl(spark, cfg)
    message = str(info.value)
    for pattern in patterns:
        assert re.search(pattern, message), f"{pattern!r} not in: {message}"
    previous.assert_untouched()
    return message


# ---- corrupt and mismatched Parquet files ------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_parquet_file_is_named(spark, tmp_path, previous, damage):
    good = _write_parts(tmp_path / "in", [_table(60, seed=s, start=60 * s) for s in range(3)])
    victim = good[1]
    data = victim.read_bytes()
    victim.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"not parquet at all " * 20,
                        "empty": b""}[damage])
    _fails(spark, _cfg(tmp_path, tmp_path / "in", previous.target, id_column="id"), previous,
           re.escape(str(victim)), r"1 of 3 file\(s\)", "not readable Parquet", "replace or remove")


def test_corrupt_data_pages_behind_a_good_footer_are_named(spark, tmp_path, previous):
    # The footer is intact (so the up-front footer check passes); the column data is garbage, which only
    # the Spark read finds: its failure comes back as a DataError naming the file.
    good = _write_parts(tmp_path / "in", [_table(150, seed=s, start=150 * s) for s in range(2)])
    victim = good[1]
    data = bytearray(victim.read_bytes())
    footer_start = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    data[4:footer_start] = b"\x5a" * (footer_start - 4)
    victim.write_bytes(bytes(data))
    assert pq.read_metadata(victim).num_rows == 150
    _fails(spark, _cfg(tmp_path, tmp_path / "in", previous.target, id_column="id"), previous,
           f"cannot read input file {re.escape(str(victim))}", "replace or remove it")


def test_parquet_file_with_another_column_type_is_named(spark, tmp_path, previous):
    parts = _write_parts(tmp_path / "in", [
        _table(60, seed=0), _table(60, seed=1, start=60),
        _table(60, seed=2, start=120, f1=np.array([f"{v:.3f}" for v in np.arange(60)]))])
    _fails(spark, _cfg(tmp_path, tmp_path / "in", previous.target, id_column="id"), previous,
           rf"column 'f1' has type string in {re.escape(str(parts[2]))} but double in {re.escape(str(parts[0]))}",
           r"1 of 3 Parquet file", "rewrite or remove")


def test_parquet_file_missing_a_column_is_named(spark, tmp_path, previous):
    parts = _write_parts(tmp_path / "in", [_table(60, seed=0), _table(60, seed=1, start=60).drop(["f2"])])
    message = _fails(spark, _cfg(tmp_path, tmp_path / "in", previous.target, id_column="id"), previous,
                     rf"column 'f2' is missing from 1 of 2 Parquet file\(s\)", re.escape(str(parts[1])),
                     "Rewrite or remove", "data.features")
    assert "null" in message  # says what Spark would silently have done
    # a column that is not used does not matter when data.features lists the ones that are
    extra = _write_parts(tmp_path / "in2", [_table(90, seed=0), _table(90, seed=1, start=90, note=["x"] * 90)])
    assert extra
    manifest = run_etl(spark, _cfg(tmp_path, tmp_path / "in2", tmp_path / "ok", id_column="id", features=["f1", "f2"]))
    assert sum(s.rows for s in manifest.splits.values()) == 180


def test_csv_files_with_another_header_are_named(spark, tmp_path, previous):
    folder = tmp_path / "in"
    folder.mkdir()
    rows = [f"{i},{i * 0.5},{i % 7},{'cat' if i % 2 else 'dog'}" for i in range(60)]
    (folder / "a.csv").write_text("id,f1,f2,label\n" + "\n".join(rows) + "\n")
    (folder / "b.csv").write_text("id,f2,f1,label\n" + "\n".join(rows) + "\n")  # same names, other order
    _fails(spark, _cfg(tmp_path, folder, previous.target, source="csv", id_column="id"), previous,
           # whichever file Spark took the header from, the other one is named
           rf"{re.escape(str(folder))}/[ab]\.csv", "CSV header does not conform", "Header: id, f2, f1, label|Header: id, f1, f2, label",
           "replace or remove it")


# ---- columns ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting, patterns", [
    ({"features": ["f1", "nope"]}, [r"feature column\(s\) \['nope'\]", "data.features"]),
    ({"label": "target"}, [r"label column 'target' \(data.label\)", "set data.label"]),
    ({"id_column": "row_id"}, [r"id column 'row_id' \(data.id_column\)"]),
])
def test_missing_feature_label_or_id_column(spark, tmp_path, previous, setting, patterns):
    _write_parts(tmp_path / "in", [_table(60)])
    settings = {"id_column": "id", **setting}
    message = _fails(spark, _cfg(tmp_path, tmp_path / "in", previous.target, **settings), previous, *patterns)
    assert "'f1', 'f2'" in message or "columns" in message  # lists what is there


# ---- values ----------------------------------------------------------------------------------------------


def _csv_with_text(tmp_path) -> Path:
    csv = tmp_path / "in.csv"
    lines = ["id,f1,f2,label"]
    for i in range(150):
        f1 = "n/a" if i in (7, 70) else f"{i * 0.5}"
        f2 = "oops" if i in (3, 33, 99) else ("" if i == 120 else f"{(i * 37) % 11}")  # "" is null, not text
        lines.append(f"{i},{f1},{f2},{i % 3}")
    csv.write_text("\n".join(lines) + "\n")
    return csv


def test_non_numeric_strings_rejected_with_counts(spark, tmp_path, previous):
    csv = _csv_with_text(tmp_path)
    _fails(spark, _cfg(tmp_path, csv, previous.target, source="csv", id_column="id", invalid_rows="reject"),
           previous, r"6 of 150 rows", re.escape(str(csv)), r"non-numeric: \{'f1': 2, 'f2': 3\}",
           r"by column: \{'f1': 2, 'f2': 4\}", "set data.invalid_rows=drop")


def test_non_numeric_strings_dropped_and_counted(spark, tmp_path):
    csv = _csv_with_text(tmp_path)
    manifest = run_etl(spark, _cfg(tmp_path, csv, source="csv", id_column="id", invalid_rows="drop"))
    report = manifest.etl_report
    assert report["non_numeric"] == {"f1": 2, "f2": 3}
    assert report["invalid_by_column"] == {"f1": 2, "f2": 4}
    assert (report["input_rows"], report["invalid_rows"], report["output_rows"]) == (150, 6, 144)
    assert sum(s.rows for s in manifest.splits.values()) == 144
    x, _ = read_tensors(manifest.files("train"))
    assert np.isfinite(x["numeric"].numpy()).all()


def _with_bad_values(rows=150):
    table = _table(rows, seed=3)
    f1, f2 = table.column("f1").to_numpy().copy(), table.column("f2").to_numpy().copy()
    f1[[1, 2]] = np.nan
    f2[[5]], f2[[6]], f2[[7]] = np.inf, -np.inf, np.nan
    f1_mask = np.zeros(rows, dtype=bool)
    f1_mask[10] = True  # one null in f1
    labels = table.column("label").to_pylist()
    labels[20] = labels[21] = None  # two null labels
    return table.set_column(1, "f1", pa.array(f1, mask=f1_mask)).set_column(2, "f2", pa.array(f2)) \
        .set_column(3, "label", pa.array(labels, pa.string()))


def test_nan_inf_null_rejected_with_counts_per_column(spark, tmp_path, previous):
    _write_parts(tmp_path / "in", [_with_bad_values()])
    _fails(spark, _cfg(tmp_path, tmp_path / "in", previous.target, id_column="id", invalid_rows="reject"), previous,
           r"8 of 150 rows", r"by column: \{'f1': 3, 'f2': 3, 'label': 2\}", re.escape(str(tmp_path / "in")),
           "data.invalid_rows=drop")


def test_nan_inf_null_dropped_with_counts_per_column(spark, tmp_path):
    _write_parts(tmp_path / "in", [_with_bad_values()])
    manifest = run_etl(spark, _cfg(tmp_path, tmp_path / "in", id_column="id"))
    assert manifest.etl_report["invalid_by_column"] == {"f1": 3, "f2": 3, "label": 2}
    assert (manifest.etl_report["invalid_rows"], manifest.etl_report["output_rows"]) == (8, 142)
    assert sum(s.rows for s in manifest.splits.values()) == 142


def test_all_rows_invalid_is_an_error(spark, tmp_path, previous):
    _write_parts(tmp_path / "in", [_table(40, f1=np.full(40, np.nan))])
    _fails(spark, _cfg(tmp_path, tmp_path / "in", previous.target, id_column="id"), previous,
           r"all 40 input rows .* are invalid", r"'f1': 40")


# ---- labels outside data.classes -------------------------------------------------------------------------


def _with_unknown_labels():
    table = _table(150, seed=4)
    labels = table.column("label").to_pylist()
    for i in (3, 50, 90):
        labels[i] = "bird"
    labels[120] = "fish"
    return table.set_column(3, "label", pa.array(labels)), labels


def test_labels_outside_the_configured_classes_rejected(spark, tmp_path, previous):
    table, _ = _with_unknown_labels()
    _write_parts(tmp_path / "in", [table])
    _fails(spark, _cfg(tmp_path, tmp_path / "in", previous.target, id_column="id", classes=["dog", "cat"],
                       invalid_rows="reject"), previous,
           r"4 of 150 rows", r"4 label\(s\) in column 'label' are not in data.classes \['dog', 'cat'\]",
           r"e\.g\. \['bird', 'fish'\]", r"by column: \{'label': 4\}", "add the missing labels to data.classes",
           "data.invalid_rows=drop")


def test_labels_outside_the_configured_classes_dropped_and_mapping_follows_the_config(spark, tmp_path):
    table, labels = _with_unknown_labels()
    _write_parts(tmp_path / "in", [table])
    manifest = run_etl(spark, _cfg(tmp_path, tmp_path / "in", id_column="id", classes=["dog", "cat"]))
    assert manifest.label_mapping == ("dog", "cat")  # the configured order, not sorted
    report = manifest.etl_report
    assert report["invalid_by_column"] == {"label": 4} and report["invalid_rows"] == 4
    assert report["labels_not_in_classes"] == 4 and report["label_examples_not_in_classes"] == ["bird", "fish"]
    y = np.concatenate([read_tensors(manifest.files(split))[1].numpy() for split in ("train", "validation", "test")])
    assert len(y) == 146
    assert (y == 0).sum() == labels.count("dog") and (y == 1).sum() == labels.count("cat")


def test_numeric_labels_with_configured_classes(spark, tmp_path, previous):
    labels = np.arange(150) % 3
    labels[[10, 11]] = 7  # not a configured class
    _write_parts(tmp_path / "in", [_table(150, label=labels)])
    manifest = run_etl(spark, _cfg(tmp_path, tmp_path / "in", id_column="id", classes=[2, 0, 1]))
    assert manifest.label_mapping == ("2", "0", "1")
    assert manifest.etl_report["invalid_by_column"] == {"label": 2}
    assert manifest.etl_report["label_examples_not_in_classes"] == ["7"]
    y = np.concatenate([read_tensors(manifest.files(split))[1].numpy() for split in ("train", "validation", "test")])
    assert [(y == i).sum() for i in range(3)] == [(labels == c).sum() for c in (2, 0, 1)]
    _fails(spark, _cfg(tmp_path, tmp_path / "in", previous.target, id_column="id", classes=["a", "b"]), previous,
           r"data.classes lists 'a'", r"label column 'label' is numeric", "as integers")


# ---- empty and too small ---------------------------------------------------------------------------------


def test_empty_csv_with_only_a_header(spark, tmp_path, previous):
    csv = tmp_path / "empty.csv"
    csv.write_text("id,f1,f2,label\n")
    _fails(spark, _cfg(tmp_path, csv, previous.target, source="csv", id_column="id"), previous,
           r"has no rows", re.escape(str(csv)), "point data.path at")


def test_empty_csv_file(spark, tmp_path, previous):
    csv = tmp_path / "nothing.csv"
    csv.write_text("")
    _fails(spark, _cfg(tmp_path, csv, previous.target, source="csv"), previous,
           r"has no columns", re.escape(str(csv)), "header row")


def test_empty_parquet_folder(spark, tmp_path, previous):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "_SUCCESS").touch()  # markers do not count as data
    _fails(spark, _cfg(tmp_path, folder, previous.target, id_column="id"), previous,
           r"holds no Parquet files", re.escape(str(folder)), "point data.path at")


def test_parquet_files_with_zero_rows(spark, tmp_path, previous):
    _write_parts(tmp_path / "in", [_table(0), _table(0)])
    _fails(spark, _cfg(tmp_path, tmp_path / "in", previous.target, id_column="id"), previous,
           r"has no rows", re.escape(str(tmp_path / "in")), "point data.path at")


def test_dataset_smaller_than_one_batch_per_worker(spark, tmp_path, previous):
    table = _table(120, seed=5)
    _write_parts(tmp_path / "in", [table])
    cfg = _cfg(tmp_path, tmp_path / "in", previous.target, id_column="id", batch_size=64)
    split = {r.id: r[SPLIT_COLUMN] for r in assign_split(spark.read.parquet(str(tmp_path / "in")), ["id"],
                                                         cfg.data.split).collect()}
    train_rows = sum(1 for v in split.values() if v == "train")
    assert train_rows < 2 * 64
    _fails(spark, cfg, previous, rf"the train split has {train_rows} rows", r"120 input rows",
           r"parallelism.data=2 workers x train.batch_size=64 = 128 rows",
           r"fewer workers \(parallelism.data\), a smaller train.batch_size, or more data")


def test_training_plan_rejects_a_shard_set_smaller_than_one_batch_per_worker(previous):
    manifest = load_manifest(previous.target)
    train = manifest.split("train")
    smallest = train.rows // 2  # each worker's part of the epoch's row stream (rows are not tied to shards)
    assert steps_per_epoch(manifest, 2, BATCH) >= 1
    with pytest.raises(DataError) as info:
        steps_per_epoch(manifest, 2, smallest + 1)
    message = str(info.value)
    for part in (str(previous.target), f"{train.rows} train rows for 2 workers", f"smallest part: {smallest} rows",
                 f"train.batch_size={smallest + 1}", "parallelism.data=2", "smaller train.batch_size",
                 "re-run `shardline etl` with more data"):
        assert part in message, (part, message)
    previous.assert_untouched()
