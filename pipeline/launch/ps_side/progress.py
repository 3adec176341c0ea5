"""Per-epoch progress on the driver, assembled from the metrics every rank reports to the PS."""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

log = logging.getLogger(__name__)
# Forwarded worker lines get their own logger, so a deployment can route or silence them.
worker_log = logging.getLogger("pipeline.worker.remote")
MAX_FORWARDED_LINES = 200
MAX_FORWARDED_CHARS = 2000


class EpochProgress:
    """Collects per-rank epoch reports; when all ranks have reported an epoch, logs one line and records it.

    Called from PS connection threads, hence the lock.
    """

    def __init__(self, world_size: int, epochs: int, on_epoch: Optional[Callable[[dict], None]] = None):
        self.world_size = world_size
        self.epochs = epochs
        self.history: list[dict] = []
        self._pending: dict[int, dict[int, dict]] = {}
        self._lock = threading.Lock()
        self._on_epoch = on_epoch

    def __call__(self, rank: int, metrics: dict) -> None:
        lines = metrics.get("log")
        if isinstance(lines, list):  # worker log lines streamed over the PS connection
            for line in lines[:MAX_FORWARDED_LINES]:
                worker_log.info("[rank %d] %s", rank, str(line)[:MAX_FORWARDED_CHARS])
        if "epoch" not in metrics:
            return
        with self._lock:
            if any(row["epoch"] == int(metrics["epoch"]) for row in self.history):
                return  # already complete (a resumed attempt never repeats it; be safe anyway)
            reports = self._pending.setdefault(int(metrics["epoch"]), {})
            reports[rank] = metrics
            if len(reports) < self.world_size:
                return
            row = self._summarize(int(metrics["epoch"]), self._pending.pop(int(metrics["epoch"])))
            self.history.append(row)
        self._announce(row)

    def _announce(self, row: dict) -> None:
        log.info("epoch %d/%d | %.0f samples/s | train loss %.4f%s%s", row["epoch"] + 1, self.epochs,
                 row["samples_per_s"], row["train_loss"],
                 f" | val loss {row['val_loss']:.4f}" if "val_loss" in row else "",
                 f" | val acc {row['val_accuracy']:.4f}" if "val_accuracy" in row else "")
        if self._on_epoch is not None:
            self._on_epoch(row)

    def replay(self, history: list[dict]) -> None:
        """Take epochs summarized elsewhere (the PS in rank 0's task): record and announce the new ones."""
        for row in history:
            with self._lock:
                if any(known["epoch"] == row["epoch"] for known in self.history):
                    continue
                self.history.append(dict(row))
            self._announce(dict(row))

    def restore(self, reports: dict) -> None:
        """Start from what ``reports()`` gave to a checkpoint (a resumed run): the summarized epochs and the
        reports of epochs some ranks had not reached yet (absent from checkpoints that predate them)."""
        with self._lock:
            self.history = [dict(row) for row in reports["history"]]
            self._pending = {}
            for epoch, rank, metrics in reports.get("pending") or []:
                self._pending.setdefault(int(epoch), {})[int(rank)] = dict(metrics)

    def close_abandoned(self, unreported: list[tuple[int, int]]) -> None:
        """Summarize epochs from the reports that did arrive when the other ranks will never send theirs:
        a rank that died between an epoch's last step and its report resumes after that epoch. The row
        says how many ranks it covers (``ranks_reported``)."""
        for epoch in sorted({epoch for _, epoch in unreported}):
            with self._lock:
                reports = self._pending.pop(epoch, None)
                if not reports:
                    continue  # no rank reported it: there is nothing to summarize
                row = {**self._summarize(epoch, reports), "ranks_reported": len(reports)}
                self.history.append(row)
                self.history.sort(key=lambda known: known["epoch"])
            log.warning("epoch %d: only rank(s) %s reported it before the failure; its row covers those",
                        epoch + 1, sorted(reports))
            self._announce(row)

    def reports(self) -> dict:
        """What a checkpoint keeps of the progress: the history and the pending reports. A rank resumed
        past an epoch never reports it again, so its report must survive with the checkpoint."""
        with self._lock:
            return {"history": [dict(row) for row in self.history],
                    "pending": [[epoch, rank, {k: v for k, v in metrics.items() if k != "log"}]
                                for epoch, by_rank in sorted(self._pending.items())
                                for rank, metrics in sorted(by_rank.items())]}

    @staticmethod
    def _summarize(epoch: int, reports: dict[int, dict]) -> dict:
        samples = sum(r["samples"] for r in reports.values())
        seconds = max(r["seconds"] for r in reports.values())
        row = {
            "epoch": epoch,
            "step": max(r["step"] for r in reports.values()),
            # Pipeline stages other than the last have no loss (and count no samples): left out here.
            "train_loss": sum(r["train_loss"] * r["samples"] for r in reports.values() if "train_loss" in r)
            / max(sum(r["samples"] for r in reports.values() if "train_loss" in r), 1),
            "samples_per_s": samples / max(seconds, 1e-9),
            "epoch_seconds": seconds,
        }
        # PS consistency metrics (every ps.mode reports them): the worst rank's waiting and staleness,
        # and the spread of per-rank steps (async/ssp ranks may be at different steps).
        if all("wait_s" in r for r in reports.values()):
            row["wait_s"] = max(r["wait_s"] for r in reports.values())
        if all("staleness_max" in r for r in reports.values()):
            row["staleness_max"] = max(r["staleness_max"] for r in reports.values())
            row["staleness_mean"] = sum(r.get("staleness_mean", 0.0) for r in reports.values()) / len(reports)
        row["step_min"] = min(r["step"] for r in reports.values())
        # Per worker, as step metrics: where a slow rank or a waiting rank shows up.
        for rank, r in sorted(reports.items()):
            row[f"rank{rank}/samples_per_s"] = r["samples"] / max(r["seconds"], 1e-9)
            if "train_loss" in r:
                row[f"rank{rank}/train_loss"] = r["train_loss"]
            for key in ("wait_s", "staleness_mean", "step_time_s", "cpu_s", "compute_s", "idle_s", "bubble_fraction",
                        "bytes_sent"):
                if key in r:
                    row[f"rank{rank}/{key}"] = r[key]
        # Pipeline stages: per stage, summed over its replicas (bubble = idle / (idle + compute)).
        by_stage: dict[int, list[dict]] = {}
        for r in reports.values():
            if "stage" in r:
                by_stage.setdefault(int(r["stage"]), []).append(r)
        for stage, rs in sorted(by_stage.items()):
            compute, idle = sum(r["compute_s"] for r in rs), sum(r["idle_s"] for r in rs)
            row[f"stage{stage}/compute_s"] = compute / len(rs)
            row[f"stage{stage}/idle_s"] = idle / len(rs)
            row[f"stage{stage}/bubble_fraction"] = idle / (idle + compute) if idle + compute > 0 else 0.0
            row[f"stage{stage}/bytes_sent"] = sum(r["bytes_sent"] for r in rs)
        for key in ("val_loss", "val_accuracy"):
            values = [r[key] for r in reports.values() if key in r]
            if values:
                row[key] = values[0]
        from pipeline.worker.timing import summarize

        row.update(summarize(reports))  # train.profile: the time/* breakdown, averaged over ranks
        return row


class StepProgress:
    """A live progress bar on a terminal (steps, steps/s, last loss, ETA), fed by polling the PS version.

    Off a terminal (logs, spark-submit, CI) it stays silent: the per-epoch lines already say the same
    thing without control characters.
    """

    def __init__(self, version: Callable[[], int], total_steps: int, stream=None, interval_s: float = 0.5,
                 width: int = 30):
        import sys

        self._version = version
        self._total = max(total_steps, 1)
        self._stream = stream if stream is not None else sys.stderr
        self._interval_s = interval_s
        self._width = width
        self._loss: Optional[float] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.enabled = bool(getattr(self._stream, "isatty", lambda: False)())

    def update_loss(self, row: dict) -> None:
        self._loss = row.get("train_loss", self._loss)

    def render(self, done: int, elapsed_s: float, counted: Optional[int] = None) -> str:
        """One bar line; the rate is `counted` steps (default: all done) over `elapsed_s`."""
        counted = done if counted is None else counted
        rate = counted / elapsed_s if elapsed_s > 0 else 0.0
        filled = int(self._width * min(done, self._total) / self._total)
        eta = f"{(self._total - done) / rate:.0f}s" if rate > 0 else "?"
        loss = f" | loss {self._loss:.4f}" if self._loss is not None else ""
        return (f"[{'#' * filled}{'.' * (self._width - filled)}] {done}/{self._total} steps | "
                f"{rate:.1f} steps/s{loss} | ETA {eta}")

    def __enter__(self) -> "StepProgress":
        self._stop.clear()  # entered once per barrier attempt: a retry draws too
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="shardline-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._stream.write("\n")
            self._stream.flush()

    def _run(self) -> None:
        import time

        # The clock starts at the first applied step, so executor start-up does not dilute the rate.
        started: Optional[float] = None
        start_version = self._version()
        while not self._stop.wait(self._interval_s):
            done = self._version()
            if started is None and done > start_version:
                started, start_version = time.monotonic(), done
            elapsed = time.monotonic() - started if started is not None else 0.0
            rate_done = done - start_version if started is not None else 0
            self._stream.write("\r" + self.render(done, elapsed, rate_done) + "\x1b[K")
            self._stream.flush()
            if done >= self._total:
                return


def unreported_epochs(reports: dict, resume_steps: dict[int, int], steps_per_epoch: int) -> list[tuple[int, int]]:
    """(rank, epoch) pairs a rank has stepped past but whose report is not in ``reports`` (as
    ``EpochProgress.reports()`` gives). A rank reports an epoch just after its last step, so a PS
    snapshot can run ahead of the reports; resuming from it would lose those epochs' rows for good."""
    done = {int(row["epoch"]) for row in reports["history"]}
    pending = {(int(rank), int(epoch)) for epoch, rank, _ in reports["pending"]}
    return [(rank, epoch) for rank, step in sorted(resume_steps.items())
            for epoch in range(step // max(steps_per_epoch, 1))
            if epoch not in done and (rank, epoch) not in pending]
