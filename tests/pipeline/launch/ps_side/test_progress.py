import io

from pipeline.launch.ps_side.progress import EpochProgress, StepProgress


def test_epoch_lines_wait_for_every_rank_and_aggregate():
    rows = []
    progress = EpochProgress(world_size=2, epochs=3, on_epoch=rows.append)
    # Each rank's part of the validation split as sums (pipeline.worker.validation): the row has the whole's.
    progress(0, {"epoch": 0, "step": 10, "train_loss": 1.0, "samples": 100, "seconds": 2.0,
                 "val_loss_sum": 6.0, "val_weight": 10.0, "val_rows": 10, "val_correct": 5})
    assert rows == []
    progress(1, {"epoch": 0, "step": 10, "train_loss": 3.0, "samples": 300, "seconds": 4.0,
                 "val_loss_sum": 2.0, "val_weight": 10.0, "val_rows": 10, "val_correct": 9})
    (row,) = rows
    assert row["train_loss"] == (1.0 * 100 + 3.0 * 300) / 400  # sample-weighted
    assert row["samples_per_s"] == 400 / 4.0  # the slowest rank bounds the epoch
    assert row["val_loss"] == 8.0 / 20 and row["val_accuracy"] == 14 / 20 and row["val_rows"] == 20
    assert progress.history == rows


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_step_bar_shows_steps_loss_and_finishes_at_the_final_count():
    steps = [40]
    bar = StepProgress(lambda: steps[0], total_steps=100, stream=FakeTTY(), interval_s=0.01)
    assert bar.enabled and not bar.notebook  # a given stream: a plain tqdm bar, not a widget
    with bar:
        bar.update_loss({"train_loss": 0.25})
        steps[0] = 60  # stopped early (or the last poll missed it): the closing draw still shows it
    text = bar._stream.getvalue()
    assert "training:" in text and "40/100" in text and "60/100" in text and "loss 0.2500" in text
    assert "step/s" in text and text.endswith("\n")  # tqdm closes the line: later log lines start clean


def test_step_bar_is_silent_off_a_terminal():
    stream = io.StringIO()
    with StepProgress(lambda: 1, total_steps=10, stream=stream, interval_s=0.01) as bar:
        assert not bar.enabled
    assert stream.getvalue() == ""


def test_step_bar_draws_on_a_terminal_while_steps_advance():
    import time

    stream = FakeTTY()
    versions = iter(range(0, 1000))
    with StepProgress(lambda: next(versions), total_steps=5, stream=stream, interval_s=0.01):
        deadline = time.monotonic() + 10  # wait for the drawing thread to reach the total (a slow CI core)
        while "5/5" not in stream.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert "\r" in stream.getvalue() and "5/5" in stream.getvalue() and "100%" in stream.getvalue()


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
    progress(0, {"epoch": 1, "step": 8, "train_loss": 0.5, "samples": 40, "seconds": 2.0,
                 "val_loss_sum": 3.0, "val_weight": 10.0, "val_rows": 10, "val_correct": 9})
    # Rank 1 pushed epoch 1's last step, then died before reporting; the retry resumes both at step 8.
    missing = unreported_epochs(progress.reports(), {0: 8, 1: 8}, steps_per_epoch=4)
    assert missing == [(1, 1)]
    progress.close_abandoned(missing)
    assert [row["epoch"] for row in rows] == [0, 1] and progress.history == rows
    assert rows[1]["ranks_reported"] == 1 and rows[1]["train_loss"] == 0.5
    # Only rank 0's part of the validation split: the row says how many rows its figures cover.
    assert rows[1]["val_accuracy"] == 0.9 and rows[1]["val_rows"] == 10
    progress(1, {"epoch": 1, "step": 8, "train_loss": 0.7, "samples": 40, "seconds": 2.0})  # a late report
    assert len(rows) == 2  # ignored: the epoch is closed
    assert unreported_epochs(progress.reports(), {0: 8, 1: 8}, steps_per_epoch=4) == []


def test_step_bar_draws_again_for_a_retried_attempt():
    stream = FakeTTY()
    bar = StepProgress(lambda: 3, total_steps=5, stream=stream, interval_s=0.01)
    for attempt in (1, 2):  # the driver enters the same bar once per barrier attempt
        before = stream.getvalue().count("training:")
        with bar:
            pass
        assert stream.getvalue().count("training:") > before, f"attempt {attempt} drew nothing"
