"""The clicks source: a Spark-generated click log with typed columns, Zipf skew, nulls and a learnable label."""
import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.config import build
from pipeline.config.loader import load
from pipeline.config.workdir import Workdir
from pipeline.errors import ConfigError
from pipeline.etl.clicks import SPEC_FILE, clicks_raw_path, generate_clicks
from pipeline.etl.sources import builtin_id_column, read_source
from udfs.clicks import zipf_ranks, zipf_sampler


def _cfg(tmp_path, **clicks):
    spec = {"rows": 6000, "numeric": 4, "categorical": 3, "vocab": 500, "big_vocab": 5000, "partitions": 2,
            "seed": 7, **clicks}
    return build({"name": "clicks", "workdir": str(tmp_path), "data": {"source": "clicks", "clicks": spec}})


def _table(path):
    return pq.read_table(path).sort_by("id")


def test_lands_typed_columns_with_skew_nulls_and_a_learnable_label(spark, tmp_path):
    cfg = _cfg(tmp_path)
    path = generate_clicks(spark, cfg.data, cfg.workdir)
    assert path == Workdir.of(cfg).raw_clicks.absolute() and (path / "_SUCCESS").exists()
    table = _table(path)
    assert table.num_rows == 6000
    assert table.column_names == ["id", "n0", "n1", "n2", "n3", "c0", "c1", "c2", "label"]
    types = {f.name: str(f.type) for f in table.schema}
    assert types == {"id": "int64", **{f"n{i}": "double" for i in range(4)},
                     **{f"c{j}": "string" for j in range(3)}, "label": "int64"}
    assert table.column("id").to_pylist() == list(range(6000))

    for i in range(4):  # ~1% nulls per numeric column, never in the other columns
        assert 20 <= table.column(f"n{i}").null_count <= 110, i
    assert all(table.column(c).null_count == 0 for c in ("id", "c0", "c1", "c2", "label"))

    c1 = table.column("c1").to_pandas()
    assert c1.str.fullmatch(r"c1_\d{5}").all() and c1.map(lambda v: int(v[3:])).between(0, 499).all()
    counts = c1.value_counts()
    assert counts.iloc[0] > 20 * counts.median(), counts  # Zipf: the top id dwarfs the typical one
    c0 = table.column("c0").to_pandas()
    assert c0.str.fullmatch(r"c0_\d{5}").all() and c0.nunique() > c1.nunique()  # c0 draws from big_vocab

    labels = table.column("label").to_numpy()
    assert set(np.unique(labels)) == {0, 1} and 0.1 < labels.mean() < 0.6

    # The teacher's signal is learnable from the numeric columns alone (nulls imputed with the mean).
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score

    x = np.column_stack([table.column(f"n{i}").to_numpy(zero_copy_only=False) for i in range(4)])
    x = np.where(np.isnan(x), np.nanmean(x, axis=0), x)
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    model = LogisticRegression().fit(x[:4000], labels[:4000])
    assert roc_auc_score(labels[4000:], model.predict_proba(x[4000:])[:, 1]) > 0.6
    # ... and from a categorical column: the top ids' click rates differ beyond sampling noise.
    rates = table.to_pandas().groupby("c1")["label"].agg(["mean", "size"]).query("size >= 100")["mean"]
    assert len(rates) >= 3 and rates.max() - rates.min() > 0.1, rates


def test_deterministic_reused_while_unchanged_regenerated_when_changed(spark, tmp_path):
    cfg = _cfg(tmp_path, rows=3000)
    path = generate_clicks(spark, cfg.data, cfg.workdir)
    first = _table(path)
    stamp = (path / SPEC_FILE).stat().st_mtime_ns
    files = sorted(p.name for p in path.glob("*.parquet"))

    # Same spec: reused as is, whatever the partition count (which is not part of the data).
    assert generate_clicks(spark, _cfg(tmp_path, rows=3000, partitions=3).data, cfg.workdir) == path
    assert (path / SPEC_FILE).stat().st_mtime_ns == stamp and sorted(p.name for p in path.glob("*.parquet")) == files

    # Landed again from scratch, with other partitions: the very same rows.
    again = generate_clicks(spark, _cfg(tmp_path, rows=3000, partitions=3).data, cfg.workdir, force=True)
    assert _table(again).equals(first)
    assert len(list(again.glob("*.parquet"))) == 3

    # A changed spec in the same folder (skew is not in the name) regenerates it, with other data.
    steeper = _cfg(tmp_path, rows=3000, zipf=2.0)
    assert clicks_raw_path(steeper.data, steeper.workdir) == clicks_raw_path(cfg.data, cfg.workdir)
    changed = _table(generate_clicks(spark, steeper.data, steeper.workdir))
    assert changed.column("id").equals(first.column("id")) and not changed.column("c1").equals(first.column("c1"))
    top = changed.column("c1").to_pandas().value_counts().iloc[0]
    assert top > first.column("c1").to_pandas().value_counts().iloc[0]  # a steeper law, a bigger head
    # Another seed is another folder.
    assert clicks_raw_path(_cfg(tmp_path, seed=8).data, cfg.workdir) != path

    # read_source lands (here: reuses) it and reads it with Spark like any Parquet source.
    frame = read_source(spark, steeper.data, steeper.workdir)
    assert frame.count() == 3000 and dict(frame.dtypes)["n0"] == "double" and dict(frame.dtypes)["c2"] == "string"
    assert builtin_id_column("clicks") == "id"


def test_zipf_sampling_is_the_exact_inverse_cdf():
    for vocab in (3, 500, 70_000):
        cdf, guide = zipf_sampler(vocab, 1.1)
        u = np.random.default_rng(vocab).random(100_000)
        u[:4] = [0.0, cdf[0], np.nextafter(cdf[0], 0), 1 - 2**-53]  # bucket edges and the ends
        expected = np.minimum(np.searchsorted(cdf, u, side="right"), vocab - 1)
        assert np.array_equal(zipf_ranks(u, cdf, guide), expected), vocab


def test_clicks_config(conf_dir, tmp_path):
    cfg = load(f"{conf_dir}/clicks.yaml")
    data = cfg.data
    assert data.source == "clicks" and data.task == "classification" and data.id_column == "id"
    assert cfg.model.kind == "tabular"
    c = data.clicks
    assert (c.rows, c.numeric, c.categorical, c.vocab, c.big_vocab, c.zipf) == (100_000, 13, 26, 10_000, 1_000_000, 1.1)
    numeric = [f for f in data.features if f.type == "numeric"]
    categorical = [f for f in data.features if f.type == "categorical"]
    assert [f.name for f in numeric] == [f"n{i}" for i in range(13)] and all(f.impute == "mean" for f in numeric)
    assert [f.name for f in categorical] == [f"c{j}" for j in range(26)]
    assert categorical[0].hash_buckets == 16_384 and all(f.hash_buckets is None for f in categorical[1:])
    assert all(f.min_count == 5 for f in categorical)
    with pytest.raises(ConfigError, match="numeric or categorical"):
        build({"data": {"source": "clicks", "clicks": {"numeric": 0, "categorical": 0}}})
    assert Workdir.of(cfg).raw_clicks.name == "clicks-100000x13n26c-s0"
