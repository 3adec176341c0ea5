"""The failure account rank 0 embeds in its error when it must stop the stage itself survives Spark's error
text, including whether a retry could cure each failure."""
from pipeline.launch.task.rows import decode_failure_report, embed_failure_report, failure_of


def test_an_embedded_failure_report_round_trips_through_an_error_text():
    report = {"root_failures": [1], "failures": {"1": ["NonFiniteError: NaN at step 6", "tail\n" * 40, False],
                                                 "0": ["PSError: rank 1 failed", "", True]}}
    text = f"Job aborted: PeersStuckError: {embed_failure_report('rank(s) [2] stuck', report)} (more Spark text)"
    decoded = decode_failure_report(text)
    assert decoded["reason"] == "rank(s) [2] stuck" and decoded["root_failures"] == [1]
    cause = failure_of(1, decoded["failures"]["1"])
    assert cause.rank == 1 and cause.error.startswith("NonFiniteError") and cause.retryable is False
    assert len(cause.log_tail.splitlines()) == 15  # the tail is cut to its last lines
    assert failure_of(0, decoded["failures"]["0"]).retryable is True


def test_a_report_entry_without_the_flag_counts_as_retryable_and_garbage_decodes_to_none():
    assert failure_of(3, ["OSError: reset", ""]).retryable is True
    assert decode_failure_report("no report here") is None
    assert decode_failure_report("shardline-task-ps-failure:%%%") is None
