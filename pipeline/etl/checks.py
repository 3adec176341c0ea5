"""Checks both ETL paths share: a Spark read failure turned into an error naming the file, and the split
sizes a run needs before anything is written."""
from __future__ import annotations

import re
from contextlib import contextmanager

from pipeline.etl.clean import CleanReport, describe_input
from pipeline.errors import DataError

_READ_FAILURE = re.compile(r"Encountered error while reading file (\S+?)\.?(?:\s|$)")
_CAUSE = re.compile(r"^Caused by: (?:[\w.$]+(?:Exception|Error)): (.+)$", re.MULTILINE)


def read_failure(exc: BaseException, data) -> DataError | None:
    """A Spark job that failed reading one input file (corrupt Parquet, a column of another type, a CSV
    header that differs) as a DataError naming the file, Spark's reason and the fix; None for others."""
    text = str(exc)
    found = _READ_FAILURE.search(text)
    if not found:
        return None
    path = found.group(1)
    path = path[len("file://"):] if path.startswith("file:///") else path.removeprefix("file:")
    line = text[found.end():].split("\n", 1)[0]
    reason = line.split("SQLSTATE")[0].strip()
    cause = _CAUSE.search(text, found.end())
    if cause:
        # The root cause's message, with its continuation lines (a CSV header mismatch spans several).
        lines = [cause.group(1).strip()]
        for more in text[cause.end():].split("\n")[1:5]:
            if not more.strip() or more.startswith(("\t", "Caused by")) or more.lstrip().startswith(("at ", "...")):
                break
            lines.append(more.strip())
        reason = f"{reason} {' '.join(lines)}".strip()
    return DataError(f"cannot read input file {path} ({describe_input(data)}, data.source={data.source}): "
                     f"{reason or 'Spark could not read it'}; the file is corrupt or its schema differs from "
                     "the other files: replace or remove it and re-run the ETL")


@contextmanager
def input_errors(data):
    """Turn a Spark failure to read an input file into a DataError naming the file."""
    try:
        yield
    except DataError:
        raise
    except Exception as exc:
        error = read_failure(exc, data)
        if error is None:
            raise
        raise error from None


def check_split_sizes(totals: dict[str, int], report: CleanReport, data, workers: int,
                      batch_size: int) -> dict[str, int]:
    """Fail before anything is written when a split is too small; return the shards per split: one train
    shard per worker, validation read whole by rank 0, test spread for Spark evaluation."""
    if totals["train"] < workers * batch_size:
        # Every worker needs one full batch per step.
        raise DataError(
            f"the train split has {totals['train']} rows ({report.output_rows} valid of {report.input_rows} "
            f"input rows in {describe_input(data)}, data.split.train={data.split.train}), fewer than one batch "
            f"per worker: parallelism.data={workers} workers x train.batch_size={batch_size} = "
            f"{workers * batch_size} rows; use fewer workers (parallelism.data), a smaller train.batch_size, "
            "or more data")
    for name in ("validation", "test"):
        if totals[name] == 0 and getattr(data.split, name) > 0:
            raise DataError(f"the {name} split is empty ({report.output_rows} valid rows); "
                            f"raise data.split.{name} or add data")
    return {"train": workers, "validation": min(1, totals["validation"]), "test": min(workers, totals["test"])}
