"""The clicks source: a Spark-generated click log with typed columns, Zipf skew, nulls and a learnable label."""
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import build
from pipeline.config.loader import load
from pipeline.config.workdir import Workdir
from pipeline.errors import ConfigError
from pipeline.etl.clicks import SPEC_FILE, clicks_raw_path, generate_clicks
from pipeline.etl.sources import builtin_id_column, read_source
from udfs.clicks import ZIPF_HEAD, id_keys, make_generate_fn, rank_ids, zipf_ranks, zipf_sampler


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


def _exact_cdf(vocab, exponent):
    cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -exponent)
    return cdf / cdf[-1]


def test_zipf_sampling_is_the_exact_inverse_cdf_over_the_head():
    # Up to ZIPF_HEAD ranks the whole law is tabulated (70_000 ranks were, before the head had a bound).
    for vocab in (3, 500, ZIPF_HEAD):
        sampler = zipf_sampler(vocab, 1.1)
        cdf = sampler.cdf
        assert len(cdf) == vocab
        u = np.random.default_rng(vocab).random(100_000)
        u[:4] = [0.0, cdf[0], np.nextafter(cdf[0], 0), 1 - 2**-53]  # bucket edges and the ends
        expected = np.minimum(np.searchsorted(cdf, u, side="right"), vocab - 1)
        assert np.array_equal(zipf_ranks(u, sampler), expected), vocab
    # Past it, the head's ranks are still the exact inverse CDF of the whole law.
    vocab = 10**6
    sampler = zipf_sampler(vocab, 1.1)
    assert len(sampler.cdf) == ZIPF_HEAD and len(sampler.guide) <= 2**20 + 1
    u = np.random.default_rng(0).random(200_000) * sampler.cdf[-1]
    exact = np.searchsorted(_exact_cdf(vocab, 1.1), u, side="right")
    assert (zipf_ranks(u, sampler) != exact).sum() <= 2  # only a u within ~1e-12 of a rank's edge could differ


@pytest.mark.parametrize("exponent", [0.5, 1.0, 1.1, 2.0])
def test_zipf_ranks_follow_the_law_past_the_tabulated_head(exponent):
    vocab = 10**6
    sampler = zipf_sampler(vocab, exponent)
    exact_cdf = _exact_cdf(vocab, exponent)
    p = np.diff(exact_cdf, prepend=0.0)
    n = 1_000_000
    ranks = zipf_ranks(np.random.default_rng(1).random(n), sampler)
    assert ranks.min() >= 0 and ranks.max() < vocab
    counts = np.bincount(ranks, minlength=vocab)

    # The head: each top rank's frequency within 5 binomial sigmas of its probability.
    top = np.arange(20)
    sigma = np.sqrt(n * p[top] * (1 - p[top]))
    assert (np.abs(counts[top] - n * p[top]) < 5 * sigma + 1).all(), (counts[top], n * p[top])
    # The tail's mass, and its spread over log-spaced bands of ranks (the approximated part of the law).
    tail_mass = p[ZIPF_HEAD:].sum()
    observed = counts[ZIPF_HEAD:].sum()
    assert abs(observed - n * tail_mass) < 5 * np.sqrt(n * tail_mass * (1 - tail_mass)) + 1, (observed, n * tail_mass)
    edges = np.unique(np.geomspace(ZIPF_HEAD, vocab, 9).astype(np.int64))
    for lo, hi in zip(edges[:-1], edges[1:]):
        expected = n * p[lo:hi].sum()
        assert abs(counts[lo:hi].sum() - expected) < 5 * np.sqrt(expected) + 2, (lo, hi, counts[lo:hi].sum(), expected)

    # Uniforms drawn inside the tail alone (its mass is 9e-6 at s = 2): the exact inverse CDF's rank, but
    # for a few u at a rank's edge (the approximation moves each CDF value by < 1e-10 of the tail).
    start = sampler.cdf[-1]
    u = start + (1 - start) * np.random.default_rng(2).random(200_000)
    u = u[u < 1]
    mine = zipf_ranks(u, sampler)
    exact = np.minimum(np.searchsorted(exact_cdf, u, side="right"), vocab - 1)
    assert mine.min() >= ZIPF_HEAD - 1 and np.abs(mine - exact).max() <= 1 and (mine != exact).mean() < 1e-3


@pytest.mark.parametrize("vocab", [1, 2, 3, 10, 97, 1000, 4096, 65_537, 250_001])
def test_rank_ids_are_a_bijection_on_the_vocab(vocab):
    for j, seed in ((0, 0), (5, 123)):
        ids = rank_ids(np.arange(vocab), vocab, id_keys(j, seed))
        assert ids.dtype == np.int64 and np.array_equal(np.sort(ids), np.arange(vocab)), (vocab, j, seed)
        # A function of (seed, column, rank) alone: any subset maps the same way.
        picked = np.random.default_rng(vocab).integers(0, vocab, 1000)
        assert np.array_equal(rank_ids(picked, vocab, id_keys(j, seed)), ids[picked])


def test_rank_ids_scatter_popularity_over_the_ids():
    vocab = 100_000
    ids = rank_ids(np.arange(vocab), vocab, id_keys(1, 0))
    assert abs(np.corrcoef(np.arange(vocab), ids)[0, 1]) < 0.02  # popularity does not follow id order
    assert np.abs(np.diff(ids[:100])).min() > 0 and np.median(np.abs(np.diff(ids[:1000]))) > vocab / 10
    assert ids[:10].max() - ids[:10].min() > vocab / 4  # the top ranks are anywhere
    other = rank_ids(np.arange(vocab), vocab, id_keys(2, 0))  # another column, another mapping
    assert (ids != other).mean() > 0.99 and not np.array_equal(ids, rank_ids(np.arange(vocab), vocab, id_keys(1, 1)))
    # Beyond 2**32 ids (64-bit halves) and at 10**9: distinct and in range.
    for big in (10**9, 2**40 + 7):
        many = rank_ids(np.arange(200_000), big, id_keys(0, 0))
        assert many.min() >= 0 and many.max() < big and len(np.unique(many)) == len(many), big
        assert many.max() > big // 2


def _batch(first, n):
    return pa.RecordBatch.from_arrays([pa.array(np.arange(first, first + n, dtype=np.int64))], names=["id"])


def _generated(fn, batches):
    return pa.Table.from_batches(list(fn(iter(batches))))


@pytest.mark.parametrize("vocab", [10**7, 10**9])
def test_memory_does_not_grow_with_the_vocab(vocab):
    """10k rows of 13 numeric + 26 categorical columns with 10**9 ids a column: no table of the vocab's
    size is built (tracemalloc sees numpy's buffers; per-rank tables took ~200 MB a column at 10**7)."""
    zipf_sampler.cache_clear()  # its tables count too
    tracemalloc.start()
    try:
        table = _generated(make_generate_fn(13, 26, vocab, vocab, 1.1, 0.01, 3), [_batch(10**12, 10_000)])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MB"
    width = len(str(vocab - 1))
    for j in (0, 1, 25):
        values = table.column(f"c{j}").to_pandas()
        assert values.str.fullmatch(rf"c{j}_\d{{{width}}}").all()
        ids = values.map(lambda v: int(v.split("_")[1]))
        assert ids.between(0, vocab - 1).all() and ids.max() > vocab // 2  # ids from the whole range
        # Zipf: the top id has about the top rank's probability, 1 / H(vocab, 1.1).
        top = ids.value_counts(normalize=True).iloc[0]
        assert abs(top - {10**7: 0.1164, 10**9: 0.1072}[vocab]) < 0.015, top


def test_rows_do_not_depend_on_how_the_ids_are_batched():
    fn = make_generate_fn(3, 4, 10**7, 10**8, 1.1, 0.1, 11)  # tail ranks and walked ids included
    whole = _generated(fn, [_batch(500, 3000)])
    split = _generated(fn, [_batch(500, 1), _batch(501, 999), _batch(1500, 2000)])
    assert whole.equals(split)
    assert _generated(fn, [_batch(1500, 2000)]).equals(whole.slice(1000))


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
