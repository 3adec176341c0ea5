import io

from pipeline.launch.ps_side.progress import EpochProgress, StepProgress


def test_epoch_lines_wait_for_every_rank_and_aggregate():
    rows = []
    progress = EpochProgress(world_size=2, epochs=3, on_epoch=rows.append)
    progress(0, {"epoch": 0, "step": 10, "train_loss": 1.0, "samples": 100, "seconds": 2.0, "val_accuracy": 0.5})
    assert rows == []
    progress(1, {"epoch": 0, "step": 10, "train_loss": 3.0, "samples": 300, "seconds": 4.0})
    (row,) = rows
    assert row["train_loss"] == (1.0 * 100 + 3.0 * 300) / 400  # sample-weighted
    assert row["samples_per_s"] == 400 / 4.0  # the slowest rank bounds the epoch
    assert row["val_accuracy"] == 0.5 and progress.history == rows


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_step_bar_renders_rate_loss_and_eta():
    bar = StepProgress(lambda: 50, total_steps=100, stream=FakeTTY())
    bar.update_loss({"train_loss": 0.25})
    line = bar.render(50, 10.0)
    assert "50/100 steps" in line and "5.0 steps/s" in line and "loss 0.2500" in line and "ETA 10s" in line
    assert line.startswith("[" + "#" * 15 + "." * 15 + "]")


def test_step_bar_is_silent_off_a_terminal():
    stream = io.StringIO()
    with StepProgress(lambda: 1, total_steps=10, stream=stream, interval_s=0.01) as bar:
        assert not bar.enabled
    assert stream.getvalue() == ""


def test_step_bar_draws_on_a_terminal():
    stream = FakeTTY()
    versions = iter(range(0, 1000))
    with StepProgress(lambda: next(versions), total_steps=5, stream=stream, interval_s=0.01):
        import time

        deadline = time.monotonic() + 10  # wait for the drawing thread's first line (a slow CI core)
        while "\r[" not in stream.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert "\r[" in stream.getvalue() and "/5 steps" in stream.getvalue()


def test_worker_log_lines_reach_the_driver_log_and_per_rank_metrics_are_kept(caplog):
    import logging

    from pipeline.launch.ps_side.progress import EpochProgress

    rows = []
    progress = EpochProgress(2, 1, rows.append)
    with caplog.at_level(logging.INFO, logger="pipeline.worker.remote"):
        progress(1, {"log": ["WARNING pipeline.data: slow disk"] * 3})
        for rank in (0, 1):
            progress(rank, {"epoch": 0, "step": 10, "train_loss": 0.5, "samples": 100, "seconds": 2.0,
                            "wait_s": 0.1 * (rank + 1), "step_time_s": 0.2, "log": []})
    assert caplog.text.count("[rank 1] WARNING pipeline.data: slow disk") == 3
    [row] = rows
    assert row["rank0/wait_s"] == 0.1 and row["rank1/wait_s"] == 0.2 and row["rank1/samples_per_s"] == 50.0


def test_an_epoch_a_dead_rank_stepped_past_is_summarized_from_the_ranks_that_reported():
    from pipeline.launch.ps_side.progress import unreported_epochs

    rows = []
    progress = EpochProgress(2, 3, rows.append)
    for rank in (0, 1):
        progress(rank, {"epoch": 0, "step": 4, "train_loss": 1.0, "samples": 40, "seconds": 2.0})
    progress(0, {"epoch": 1, "step": 8, "train_loss": 0.5, "samples": 40, "seconds": 2.0, "val_accuracy": 0.9})
    # Rank 1 pushed epoch 1's last step, then died before reporting; the retry resumes both at step 8.
    missing = unreported_epochs(progress.reports(), {0: 8, 1: 8}, steps_per_epoch=4)
    assert missing == [(1, 1)]
    progress.close_abandoned(missing)
    assert [row["epoch"] for row in rows] == [0, 1] and progress.history == rows
    assert rows[1]["ranks_reported"] == 1 and rows[1]["val_accuracy"] == 0.9 and rows[1]["train_loss"] == 0.5
    progress(1, {"epoch": 1, "step": 8, "train_loss": 0.7, "samples": 40, "seconds": 2.0})  # a late report
    assert len(rows) == 2  # ignored: the epoch is closed
    assert unreported_epochs(progress.reports(), {0: 8, 1: 8}, steps_per_epoch=4) == []


def test_step_bar_draws_again_for_a_retried_attempt():
    import time

    stream = FakeTTY()
    bar = StepProgress(lambda: 3, total_steps=5, stream=stream, interval_s=0.01)
    for attempt in (1, 2):  # the driver enters the same bar once per barrier attempt
        before = stream.getvalue().count("\r[")
        with bar:
            deadline = time.monotonic() + 10
            while stream.getvalue().count("\r[") == before and time.monotonic() < deadline:
                time.sleep(0.01)
        assert stream.getvalue().count("\r[") > before, f"attempt {attempt} drew nothing"
