"""bench/chaos.py's bookkeeping, without a cluster: injection steps, recovery times from the step record,
the exactly-once accounting and the table it prints."""
import collections
import random

import pytest


@pytest.fixture(scope="module")
def chaos(load_bench):
    return load_bench("chaos")


def _records(world, steps_per_epoch, epochs, rows):
    """A clean record: rank r's part of each epoch, steps_per_epoch batches, one record per (rank, step)."""
    out, t = [], 0.0
    per_rank = len(rows) // world
    for epoch in range(epochs):
        for batch in range(steps_per_epoch):
            for rank in range(world):
                part = rows[rank * per_rank:(rank + 1) * per_rank]
                size = len(part) // steps_per_epoch
                t += 1.0
                out.append({"rank": rank, "epoch": epoch, "step": epoch * steps_per_epoch + batch, "t": t,
                            "rows": part[batch * size:(batch + 1) * size]})
    return out


def test_injection_steps_are_random_increasing_and_apart(chaos):
    steps = chaos.plan_steps(random.Random(3), 300, 5, 8)
    assert steps == sorted(steps) and len(steps) == 5
    assert all(b - a >= 8 for a, b in zip(steps, steps[1:])) and 8 <= steps[0] and steps[-1] < 292
    assert steps != chaos.plan_steps(random.Random(4), 300, 5, 8)
    with pytest.raises(ValueError, match="too few"):
        chaos.plan_steps(random.Random(0), 40, 5, 8)


def test_accounting_holds_for_a_clean_record_and_names_each_break(chaos):
    rows = [f"r{i}" for i in range(40)]
    every = collections.Counter(rows)
    records = _records(2, 4, 2, rows)
    applied = {0: 8, 1: 8}
    assert chaos.accounting(records, every, 2, 2, applied, 8) == []

    lost = [r for r in records if (r["rank"], r["step"]) != (1, 5)]
    problems = chaos.accounting(lost, every, 2, 2, applied, 8)
    assert "(rank, step) records: 1 missing, 0 extra" in problems[0] and "epoch 1: 0 rows extra, 5 missing" in problems
    twice = [dict(r, rows=records[0]["rows"]) if (r["rank"], r["step"]) == (0, 1) else r for r in records]
    assert "epoch 0: 5 rows extra, 5 missing" in chaos.accounting(twice, every, 2, 2, applied, 8)
    assert "steps_applied_by_rank is {0: 8, 1: 7}" in chaos.accounting(records, every, 2, 2, {0: 8, 1: 7}, 8)[0]


def test_recovery_is_the_first_step_of_the_next_attempt_or_driver_and_the_table_says_so(chaos):
    # generation 1 records step 13 still after the injection at t=2.5 (the failure shows later); the retry
    # (generation 2) steps at 5.5; the killed driver's successor (driver 1, generation 1 again) at 9.0
    records = [{"step": s, "t": t, "generation": g, "driver": d}
               for s, t, g, d in ((12, 2.0, 1, 0), (13, 2.6, 1, 0), (13, 5.5, 2, 0), (30, 7.0, 2, 0), (25, 9.0, 1, 1))]
    killed = chaos.Injection("python worker killed", 12, 2.5, generation=1)
    driver = chaos.Injection("driver killed, --resume", 30, 7.5, generation=2)
    idle = chaos.Injection("PS connection dropped", 31, 9.5, generation=1, driver=1)
    chaos.settle([killed, driver, idle], records)
    assert killed.recovered and killed.seconds == pytest.approx(3.0)
    assert driver.seconds == pytest.approx(1.5)
    assert not idle.recovered and idle.seconds is None
    lines = chaos.table([killed, idle]).splitlines()
    assert lines[0].split() == ["fault", "injected", "at", "step", "recovered?", "recovery", "s"]
    assert lines[1].split()[-3:] == ["12", "yes", "3.0"] and lines[2].split()[-3:] == ["31", "NO", "-"]


def test_all_records_keeps_the_undone_steps_and_tells_the_drivers_apart(chaos, tmp_path):
    (tmp_path / "rank0-pid1.jsonl").write_text('{"rank": 0, "epoch": 0, "step": 3, "t": 1.0, "rows": ["a"]}\n')
    (tmp_path / "rank0-pid2.jsonl").write_text(
        '{"rank": 0, "epoch": 0, "step": 3, "generation": 1, "t": 2.0, "rows": ["a"]}\n')
    found = chaos.all_records(tmp_path, resumed_at=1.5)
    assert [(r["t"], r["generation"], r["driver"]) for r in found] == [(1.0, 0, 0), (2.0, 1, 1)]


def test_epochs_logged_once(chaos):
    assert chaos.epochs_once([0, 1, 2], 3)
    assert not chaos.epochs_once([0, 1, 1, 2], 3) and not chaos.epochs_once([0, 2], 3)
