"""bench/_scale_tables.py: sizes as the tables print them, and the table and the ratio tables (each ratio
against its issue 47 target) from given phase rows, plain and markdown. Nothing runs."""
from __future__ import annotations

import pytest

MB = 2**20


@pytest.fixture(scope="module")
def scale_tables(load_bench):
    return load_bench("_scale_tables")


def test_sizes_print_with_suffixes(scale_tables):
    assert [scale_tables.label(n) for n in (1_000_000, 250_000, 1_500_000, 20_000, 32_000_000, 1234)] == \
        ["1M", "250k", "1.5M", "20k", "32M", "1234"]


def _result(scale_tables, pipeline, rows, phase, seconds, counted=None, **peaks):
    # local mode: no executor
    values = {k: peaks.get(k, 0 if k == "executor" else 100) * MB for k in scale_tables.KINDS}
    return scale_tables.PhaseResult(pipeline, rows, phase, counted if counted is not None else rows, seconds,
                                    seconds + 10, seconds, values)


def test_the_ratios_hold_each_size_against_the_smallest_and_the_one_before(scale_tables):
    M = 1_000_000
    results = []
    for rows, scale in ((M, 1.0), (4 * M, 1.1), (16 * M, 1.3)):
        results.append(_result(scale_tables, "synthetic", rows, "etl", rows / 1e5, driver=200 * scale, jvm=800))
        results.append(_result(scale_tables, "synthetic", rows, "train", rows / 1e5 * scale, counted=rows // 2,
                               max_worker=400))
    for rows, driver in ((250_000, 300), (2 * M, 330), (8 * M, 600)):
        results.append(_result(scale_tables, "clicks", rows, "etl", rows / 1e5, driver=driver))
    results.append(scale_tables.PhaseResult("clicks", 8 * M, "generate", 8 * M, 0.0, 5.0, 0.0, {},
                                            error="exit 1: boom"))
    ratios = scale_tables.ratio_rows(results)
    rss = {(r["pipeline"], r["sizes"], r["phase"], r["kind"]): r for r in ratios if r["what"] == "peak RSS"}
    last = rss[("synthetic", (16 * M, M), "etl", "driver")]
    assert last["value"] == pytest.approx(1.3) and last["target"] == 1.2
    assert rss[("synthetic", (4 * M, M), "etl", "driver")]["target"] is None  # the target is the largest size's
    assert rss[("synthetic", (16 * M, M), "all phases", "driver")]["value"] == pytest.approx(1.3)
    assert rss[("clicks", (8 * M, 250_000), "etl", "driver")]["value"] == pytest.approx(2.0)
    assert rss[("clicks", (2 * M, 250_000), "etl", "driver")]["value"] == pytest.approx(1.1)
    assert rss[("clicks", (2 * M, 250_000), "etl", "driver")]["target"] == 1.2  # the click ETL's: every size
    assert rss[("clicks", (8 * M, 250_000), "etl", "jvm")]["target"] is None  # clicks: the driver's target only
    per_row = {(r["pipeline"], r["sizes"], r["phase"]): r for r in ratios if r["what"] == "time per row"}
    assert per_row[("synthetic", (16 * M, 4 * M), "etl")]["value"] == pytest.approx(1.0)
    assert per_row[("synthetic", (16 * M, 4 * M), "train")]["value"] == pytest.approx(1.3 / 1.1)
    assert per_row[("synthetic", (16 * M, 4 * M), "train")]["target"] == 1.1
    assert per_row[("synthetic", (4 * M, M), "train")]["target"] is None
    assert ("clicks", (8 * M, 2 * M), "generate") not in per_row  # failed: no ratio
    tables = scale_tables.ratio_tables(results)
    text = "\n".join(scale_tables.plain(h, b) for _, h, b in tables)
    assert "1.30 OVER" in text and "1.00 ok" in text and "2.00 OVER" in text and "1.10 ok" in text
    lines = []
    scale_tables.report(results, "-", as_markdown=True, out=lines.append)
    assert "VmHWM is within 5%" in "\n".join(lines) and "markdown:" in lines
    header, body = scale_tables.rows_table(results)
    assert "executor JVM MB" not in header  # local mode: none seen
    assert body[-1][4] == "failed"
    md = scale_tables.markdown(header, body).splitlines()
    assert md[0].startswith("| pipeline | rows | phase") and md[1].startswith("|---|")
    assert len(md) == len(body) + 2
