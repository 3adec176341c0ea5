"""Per-epoch progress on the driver, assembled from the metrics every rank reports to the PS."""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

log = logging.getLogger(__name__)


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
        if "epoch" not in metrics:
            return
        with self._lock:
            reports = self._pending.setdefault(int(metrics["epoch"]), {})
            reports[rank] = metrics
            if len(reports) < self.world_size:
                return
            row = self._summarize(int(metrics["epoch"]), self._pending.pop(int(metrics["epoch"])))
            self.history.append(row)
        log.info("epoch %d/%d | %.0f samples/s | train loss %.4f%s%s", row["epoch"] + 1, self.epochs,
                 row["samples_per_s"], row["train_loss"],
                 f" | val loss {row['val_loss']:.4f}" if "val_loss" in row else "",
                 f" | val acc {row['val_accuracy']:.4f}" if "val_accuracy" in row else "")
        if self._on_epoch is not None:
            self._on_epoch(row)

    @staticmethod
    def _summarize(epoch: int, reports: dict[int, dict]) -> dict:
        samples = sum(r["samples"] for r in reports.values())
        seconds = max(r["seconds"] for r in reports.values())
        row = {
            "epoch": epoch,
            "step": max(r["step"] for r in reports.values()),
            "train_loss": sum(r["train_loss"] * r["samples"] for r in reports.values()) / max(samples, 1),
            "samples_per_s": samples / max(seconds, 1e-9),
            "epoch_seconds": seconds,
        }
        for key in ("val_loss", "val_accuracy"):
            values = [r[key] for r in reports.values() if key in r]
            if values:
                row[key] = values[0]
        return row
