"""faults.record_rows_dir: which rows each rank trained on, step by step (the exactly-once drills' record).

One JSON line per step a rank hands to the exchange: {"rank", "epoch", "step", "generation" (the attempt's),
"t", "rows": [digest, ...]}, a
row's digest the blake2b of its feature and label bytes, so two runs (or the legs of a resumed one) can be
compared row for row without a row id column. Steps that a failure later undid appear too: readers keep
the lines below the step a run resumed from (``read_steps``)."""
from __future__ import annotations

import json
import logging
import os
from typing import Optional

log = logging.getLogger(__name__)


def row_digests(x, y) -> list[str]:
    import hashlib

    import numpy as np

    arrays = [v.detach().cpu().numpy() for _, v in sorted(x.items())] if isinstance(x, dict) else [x.numpy()]
    labels = y.detach().cpu().numpy()
    rows = [np.ascontiguousarray(a.reshape(len(labels), -1)) for a in arrays]
    return [hashlib.blake2b(b"".join(r[i].tobytes() for r in rows) + labels[i].tobytes(), digest_size=8).hexdigest()
            for i in range(len(labels))]


def record_step(folder: str, rank: int, epoch: int, step: int, x, y, generation: int = 0) -> None:
    os.makedirs(folder, exist_ok=True)
    import time

    line = json.dumps({"rank": rank, "epoch": epoch, "step": step, "generation": generation, "t": time.time(),
                       "rows": row_digests(x, y)})
    with open(os.path.join(folder, f"rank{rank}-pid{os.getpid()}.jsonl"), "a") as out:
        out.write(line + "\n")


def read_steps(folder: str, below: Optional[int] = None) -> list[dict]:
    """The recorded steps (``below``: only steps < below), the last record of each (rank, step) kept (a
    retried attempt redoes the steps after the server's version), ordered by (step, rank)."""
    last: dict = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        with open(os.path.join(folder, name)) as lines:
            for entry in map(json.loads, lines):
                key = (entry["rank"], entry["step"])
                if (below is None or entry["step"] < below) and (key not in last or entry["t"] >= last[key]["t"]):
                    last[key] = entry
    return [last[key] for key in sorted(last, key=lambda k: (k[1], k[0]))]
