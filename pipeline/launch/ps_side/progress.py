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
        # Driver-side figures for the row before it is logged (the stall watch's rank<r>/stall_s).
        self.before_announce: Optional[Callable[[dict], None]] = None

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
        if self.before_announce is not None:
            self.before_announce(row)
        stalled = {k.split("/")[0][4:]: v for k, v in row.items() if k.endswith("/stall_s") and v > 0}
        log.info("epoch %d/%d | %.0f samples/s | train loss %.4f%s%s%s", row["epoch"] + 1, self.epochs,
                 row["samples_per_s"], row["train_loss"],
                 f" | val loss {row['val_loss']:.4f}" if "val_loss" in row else "",
                 f" | val acc {row['val_accuracy']:.4f}" if "val_accuracy" in row else "",
                 f" | silent: {', '.join(f'rank {r} {s:.1f}s' for r, s in stalled.items())}" if stalled else "")
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
        from pipeline.worker.timing import summarize
        from pipeline.worker.validation import combine

        row.update(combine(reports.values()))  # val_loss / val_accuracy from every rank's part of the split

        row.update(summarize(reports))  # train.profile: the time/* breakdown, averaged over ranks
        return row


class StepProgress:
    """The live step bar (steps, steps/s, last loss, ETA), fed by polling the PS version, drawn by tqdm.

    Why tqdm.auto and not our own bar: it is a widget in Jupyter and Databricks notebooks (an IPython
    kernel with ipywidgets), a bar on a terminal, and it knows terminal widths and rate smoothing.
    Off both (logs, spark-submit, CI) it stays silent: the per-epoch log lines already say the same thing
    without control characters. ``stream`` forces a plain-text bar on that stream (drawn only if it is a
    terminal); by default the bar goes where tqdm.auto puts it.
    """

    def __init__(self, version: Callable[[], int], total_steps: int, stream=None, interval_s: float = 0.5):
        import sys

        from tqdm.auto import tqdm as auto_bar
        from tqdm.notebook import tqdm as notebook_bar

        self._version = version
        self._total = max(total_steps, 1)
        self._interval_s = interval_s
        self._loss: Optional[float] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._bar = None
        self._shown_loss: Optional[float] = None
        self._note: Optional[str] = None
        self._shown_note: Optional[str] = None
        self.notebook = stream is None and issubclass(auto_bar, notebook_bar)  # an IPython kernel with widgets
        if self.notebook:
            self._bar_class, self._stream = auto_bar, None
            self.enabled = True
        else:
            from tqdm.std import tqdm as text_bar

            self._bar_class = text_bar
            self._stream = stream if stream is not None else sys.stderr
            self.enabled = bool(getattr(self._stream, "isatty", lambda: False)())

    def update_loss(self, row: dict) -> None:
        self._loss = row.get("train_loss", self._loss)

    def note(self, text: Optional[str]) -> None:
        """A state to show beside the loss (the stall watch's silent ranks); None clears it."""
        self._note = text

    def __enter__(self) -> "StepProgress":
        self._stop.clear()  # entered once per barrier attempt: a retry draws a bar of its own
        if self.enabled:
            # Made here, on the caller's thread: in a notebook the widget belongs to the running cell.
            # A resumed run starts where the checkpoint left off (initial): rate and ETA count this
            # attempt's steps only.
            kwargs = {} if self._stream is None else {"file": self._stream}
            self._bar = self._bar_class(total=self._total, initial=min(self._version(), self._total),
                                        desc="training", unit="step", dynamic_ncols=True,
                                        mininterval=self._interval_s, leave=True, **kwargs)
            self._thread = threading.Thread(target=self._run, name="shardline-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        if self._bar is not None:
            self._draw()  # the final count, also when training stopped early
            self._bar.close()
            self._bar = None

    def _draw(self) -> None:
        bar = self._bar
        if (self._loss, self._note) != (self._shown_loss, self._shown_note):
            self._shown_loss, self._shown_note = self._loss, self._note
            parts = ([f"loss {self._loss:.4f}"] if self._loss is not None else []) + ([self._note] if self._note else [])
            bar.set_postfix_str(" | ".join(parts), refresh=False)
        done = min(self._version(), self._total)
        if done > bar.n:
            bar.update(done - bar.n)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._draw()
            if self._bar.n >= self._total:
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
