"""Typed features through the real ETL: every type fitted on the train split, stored in its own dtype,
read back by the loader as dict batches; bad input fails naming the column and the fix."""
from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data import StreamingLoader, read_tensors
from pipeline.errors import ConfigError, DataError
from pipeline.etl import run_etl
from pipeline.shards import load_manifest
from tests.pipeline.typed_data import FEATURES, ROWS, typed_config as _cfg, write_typed_source as _write_source



def test_every_feature_type_is_fitted_on_train_and_stored_in_its_dtype(spark, conf_dir, tmp_path):
    cfg = _cfg(conf_dir, tmp_path, _write_source(tmp_path / "src"))
    manifest = run_etl(spark, cfg)
    features = manifest.feature_set
    assert [f.type for f in features] == ["numeric", "categorical", "categorical", "vector", "image", "text"]
    amount = features["amount"]
    assert amount.impute == "median" and amount.missing_flag and amount.standardize
    assert features.numeric_columns == ["amount", "amount__missing"]
    city = features["city"]
    vocab = manifest.vocabulary("city").to_pylist()
    assert city.vocab_size == len(vocab) > 3 and city.cardinality == len(vocab) + 2
    assert features["shop"].cardinality == 65 and features["shop"].vocabulary is None
    title = manifest.vocabulary("title").to_pylist()
    assert set(title) == {"red", "apple", "green", "pear", "banana"}  # lower-cased, split on punctuation
    assert title[0] == "apple"  # the most frequent token first
    assert manifest.split("train").rows + manifest.split("validation").rows + manifest.split("test").rows == ROWS

    schema = pq.read_schema(manifest.files("train", 0)[0])
    types = {name: schema.field(name).type for name in schema.names}
    assert types["f__city"] == pa.int64() and types["f__title__len"] == pa.int64()
    assert types["f__img"] == pa.binary(16)  # 1 x 4 x 4 pixels, one fixed-size value per row
    assert types["f__vec"].value_type == pa.float32() and types["features"].value_type == pa.float32()

    inputs, labels = read_tensors(manifest.files("train"), features=features)
    assert set(inputs) == {"numeric", "city", "shop", "vec", "img", "title", "title__len"}
    assert inputs["numeric"].shape[1] == 2 and inputs["img"].shape[1:] == (1, 4, 4)
    assert str(inputs["img"].dtype) == "torch.uint8" and str(inputs["city"].dtype) == "torch.int64"
    assert int(inputs["city"].max()) < city.cardinality and int(inputs["shop"].min()) >= 1
    flags = inputs["numeric"][:, 1]
    assert 0 < float(flags.sum()) < len(flags)  # imputed rows flagged, others not
    # every image of label 1 is bright (value 100), of label 0 black: decoded, resized, kept in row order
    assert bool(((inputs["img"].float().mean(dim=(1, 2, 3)) > 50) == (labels == 1)).all())
    assert bool((inputs["title__len"] <= 3).all())


def test_loader_serves_dict_batches_exactly_once_with_encoded_images(spark, conf_dir, tmp_path):
    features = [dict(f, storage="encoded") if f["type"] == "image" else f for f in FEATURES]
    cfg = _cfg(conf_dir, tmp_path, _write_source(tmp_path / "src"), features)
    manifest = run_etl(spark, cfg)
    schema = pq.read_schema(manifest.files("train", 0)[0])
    assert schema.field("f__img").type == pa.binary()
    files = manifest.files("train", 0)
    rows = manifest.split("train").shards[0].rows
    loader = StreamingLoader(files, steps_per_epoch=rows // 16, seed=1, rank=0, features=manifest.feature_set,
                             shuffle_buffer_rows=64, reader_threads=2)
    seen = []
    for x, y in loader.epoch(0):
        assert x["img"].shape[1:] == (1, 4, 4) and x["img"].dtype.is_floating_point is False
        assert bool(((x["img"].float().mean(dim=(1, 2, 3)) > 50) == (y == 1)).all())
        seen.append(x["vec"][:, 0])  # the row index travels in the vector
    ids = np.concatenate([s.numpy() for s in seen])
    assert len(ids) == rows and len(set(ids.tolist())) == rows
    again = np.concatenate([x["vec"][:, 0].numpy() for x, _ in loader.epoch(0, start_step=2)])
    assert again.tolist() == ids[len(ids) - len(again):].tolist()  # mid-epoch resume: the same remaining rows


def test_bad_rows_are_dropped_and_counted_or_rejected_naming_the_column(spark, conf_dir, tmp_path):
    source = _write_source(tmp_path / "src", bad_image_rows=(3, 4), short_vector_rows=(7,))
    manifest = run_etl(spark, _cfg(conf_dir, tmp_path, source))
    report = manifest.etl_report
    assert report["invalid_rows"] == 3 and report["invalid_by_column"] == {"img": 2, "vec": 1}
    with pytest.raises(DataError, match=r"img.*vec|vec.*img") as error:
        run_etl(spark, _cfg(conf_dir, tmp_path, source, invalid_rows="reject"))
    assert "not a decodable image" in str(error.value) and "invalid_rows=drop" in str(error.value)
    assert load_manifest(manifest.root).fingerprint == manifest.fingerprint  # the set is intact


def test_bad_declarations_fail_before_writing(spark, conf_dir, tmp_path):
    source = _write_source(tmp_path / "src", rows=200)
    with pytest.raises(DataError, match=r"'city' has type string.*type: vector.*array of numbers"):
        run_etl(spark, _cfg(conf_dir, tmp_path, source, [{"name": "city", "type": "vector", "length": 2}]))
    with pytest.raises(DataError, match=r"'amount' has type double.*type: image"):
        run_etl(spark, _cfg(conf_dir, tmp_path, source, [{"name": "amount", "type": "image", "height": 2,
                                                          "width": 2}]))
    with pytest.raises(DataError, match=r"'nope'.*not in the input"):
        run_etl(spark, _cfg(conf_dir, tmp_path, source, [{"name": "nope", "type": "categorical"}]))
    with pytest.raises(DataError, match=r"more than max_vocab=2.*hash_buckets"):
        run_etl(spark, _cfg(conf_dir, tmp_path, source, [{"name": "city", "type": "categorical", "max_vocab": 2}]))
    with pytest.raises(ConfigError, match="data.features"):
        _cfg(conf_dir, tmp_path, source, [{"name": "city", "type": "colour"}])
    assert not (tmp_path / "work" / "shards").exists() or not any((tmp_path / "work" / "shards").iterdir())


def test_manifest_records_the_fit_in_its_fingerprint(spark, conf_dir, tmp_path):
    source = _write_source(tmp_path / "src", rows=300)
    first = run_etl(spark, _cfg(conf_dir, tmp_path, source))
    again = run_etl(spark, _cfg(conf_dir, tmp_path, source))
    assert first.fingerprint == again.fingerprint
    other = run_etl(spark, _cfg(conf_dir, tmp_path, source, [dict(f, min_count=1) if f["name"] == "city" else f
                                                             for f in FEATURES]))
    assert other.fingerprint != first.fingerprint
    stored = json.loads(open(os.path.join(first.root, "manifest.json")).read())
    assert stored["features"][1]["vocabulary"] == "vocab/city.parquet"


def test_a_frozen_fit_preprocesses_later_partitions_alike_and_merges(spark, conf_dir, tmp_path):
    """The incremental workflow's later partitions reuse the first one's fit; the merged set reads the
    vocabularies from the first part."""
    from pipeline.shards.merge import merge_manifests

    first = run_etl(spark, _cfg(conf_dir, tmp_path, _write_source(tmp_path / "a", rows=300, seed=1),
                                shards_dir=str(tmp_path / "sets" / "p=a")))
    later = run_etl(spark, _cfg(conf_dir, tmp_path, _write_source(tmp_path / "b", rows=300, seed=2),
                                shards_dir=str(tmp_path / "sets" / "p=b")), statistics=first)
    assert later.features == first.features  # statistics, vocabularies, hash buckets: all frozen
    assert later.vocabulary("city").to_pylist() == first.vocabulary("city").to_pylist()
    merged = merge_manifests([first, later], tmp_path / "sets", "merged")
    assert merged.vocabulary("title").to_pylist() == first.vocabulary("title").to_pylist()
    inputs, labels = read_tensors(merged.files("train"), features=merged.feature_set)
    assert len(labels) == first.split("train").rows + later.split("train").rows
    with pytest.raises(DataError, match="frozen fit"):
        run_etl(spark, _cfg(conf_dir, tmp_path, str(tmp_path / "b"), FEATURES[:2],
                            shards_dir=str(tmp_path / "sets" / "p=c")), statistics=first)
