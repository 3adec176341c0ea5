"""Durable training checkpoints: the PS state plus what a resumed run must agree with.

One file per checkpoint, `ckpt-<step>.pt`, written to a temporary name and renamed into place, so a
reader never sees a half-written one; the newest `keep` are kept. The directory is a local path or any
fsspec URL (s3://, gs://, abfss://, dbfs:/...). Files are torch.save'd dicts of tensors and plain
values and are loaded with weights_only=True: a checkpoint can never run code.
"""
from __future__ import annotations

import io
import logging
import re
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Optional

from pipeline.errors import ConfigError

log = logging.getLogger(__name__)

FORMAT = 1
_NAME = re.compile(r"ckpt-(\d{12})\.pt$")


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    step: int


class CheckpointStore:
    """Save, list, load and prune the checkpoints of one run in `directory`."""

    def __init__(self, directory: str, keep: int = 3):
        from fsspec.core import url_to_fs

        self.directory = directory.rstrip("/")
        self.keep = keep
        self._fs, self._root = url_to_fs(self.directory)

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first."""
        if not self._fs.exists(self._root):
            return []
        found = []
        for path in self._fs.ls(self._root, detail=False):
            match = _NAME.search(str(path))
            if match:
                found.append(CheckpointInfo(str(path), int(match.group(1))))
        return sorted(found, key=lambda c: c.step)

    def archive_previous(self) -> int:
        """Move checkpoints of an earlier run into `previous/` (replacing what an even earlier run left
        there), so this run's pruning, retries and a later --resume see only this run's files. Returns
        how many were moved; nothing is deleted but the run before the previous one."""
        found = self.list()
        if not found:
            return 0
        archive = f"{self._root}/previous"
        if self._fs.exists(archive):
            self._fs.rm(archive, recursive=True)
        self._fs.makedirs(archive, exist_ok=True)
        for info in found:
            self._fs.mv(info.path, f"{archive}/{info.path.rsplit('/', 1)[-1]}")
        return len(found)

    def set_aside_after(self, step: int, folder: str = "after_best") -> int:
        """Move checkpoints past ``step`` into ``folder/`` (early stopping / the divergence guard keep an
        earlier epoch: a --resume must continue from it, not from the states after it). Returns how many."""
        later = [info for info in self.list() if info.step > step]
        if later:
            self._fs.makedirs(f"{self._root}/{folder}", exist_ok=True)
        for info in later:
            self._fs.mv(info.path, f"{self._root}/{folder}/{info.path.rsplit('/', 1)[-1]}")
        return len(later)

    def latest(self) -> Optional[CheckpointInfo]:
        found = self.list()
        return found[-1] if found else None

    def save(self, state: dict[str, Any]) -> CheckpointInfo:
        """Write `state` (must hold "step") atomically, then drop all but the newest `keep`."""
        import torch

        step = int(state["step"])
        buffer = io.BytesIO()
        torch.save({**state, "format": FORMAT, "saved_at": time.time()}, buffer)
        self._fs.makedirs(self._root, exist_ok=True)
        final = f"{self._root}/ckpt-{step:012d}.pt"
        temporary = f"{self._root}/.ckpt-{step:012d}.pt.{uuid.uuid4().hex[:8]}.tmp"
        with self._fs.open(temporary, "wb") as out:
            out.write(buffer.getvalue())
        self._fs.mv(temporary, final)
        for old in self.list()[:-self.keep]:
            self._fs.rm(old.path)
        log.debug("checkpoint at step %d: %s (%d bytes)", step, final, buffer.tell())
        return CheckpointInfo(final, step)

    def load(self, info: CheckpointInfo) -> dict[str, Any]:
        import torch

        with self._fs.open(info.path, "rb") as f:
            data = io.BytesIO(f.read())
        try:
            state = torch.load(data, weights_only=True)
        except Exception as exc:
            raise ConfigError(f"checkpoint {info.path} cannot be read ({type(exc).__name__}: {exc}); delete it to "
                              "resume from the one before, or start without --resume") from None
        if state.get("format") != FORMAT:
            raise ConfigError(f"checkpoint {info.path} has format {state.get('format')}, this shardline reads "
                              f"{FORMAT}; start without --resume")
        return state


@dataclass(frozen=True)
class CheckpointMeta:
    """What every checkpoint of a run records besides the PS state, so a resume (or a retry) can check that
    it belongs to this run: the data, the model, the layout; ``extra`` holds plain values of the caller."""

    fingerprint: str
    model: dict
    world_size: int
    mode: str
    steps_per_epoch: int
    epochs: int
    seed: int
    extra: dict = field(default_factory=dict)
    # Marks one launch's checkpoints (ps.placement=task: a retry resumes only from its own run's).
    launch_id: Optional[str] = None

    def for_launch(self, launch_id: str) -> "CheckpointMeta":
        return replace(self, launch_id=launch_id)

    def record(self) -> dict[str, Any]:
        """The plain values stored in the checkpoint file."""
        values = asdict(self)
        if values["launch_id"] is None:
            del values["launch_id"]
        return values


def check_compatible(state: dict[str, Any], path: str, *, fingerprint: str, model: dict, world_size: int,
                     mode: str, steps_per_epoch: int) -> None:
    """Refuse to resume a checkpoint that belongs to other data, another model or another layout."""
    problems = []
    if state["fingerprint"] != fingerprint:
        problems.append(f"it was trained on shard set {state['fingerprint']}, the shards now are {fingerprint} "
                        "(re-run on the same shards, or start fresh)")
    if state["model"] != model:
        problems.append(f"its model is {state['model']}, the config now builds {model} (use the same model.* "
                        "settings, or start fresh)")
    if state["world_size"] != world_size or state["steps_per_epoch"] != steps_per_epoch:
        problems.append(f"it ran {state['world_size']} workers x {state['steps_per_epoch']} steps/epoch, the config "
                        f"now gives {world_size} x {steps_per_epoch} (use the same parallelism.data and "
                        "train.batch_size)")
    if state["mode"] != mode:
        problems.append(f"it ran ps.mode={state['mode']}, the config says {mode}")
    if problems:
        raise ConfigError(f"cannot resume from checkpoint {path}: " + "; ".join(problems))


class SnapshotNotReady(Exception):
    """The state to checkpoint is not consistent yet (e.g. the PS is ahead of the epoch reports that go with
    it); a periodic save retries at its next poll, a requested one is skipped."""


class Checkpointer:
    """Saves ``snapshot()`` to ``store`` every ``every`` steps of ``version()`` from a background thread,
    and on request. Runs wherever the PS runs (the driver, or rank 0's task)."""

    def __init__(self, store: CheckpointStore, snapshot: Callable[[], dict], version: Callable[[], int], every: int,
                 poll_s: float = 0.1, enabled: bool = True):
        self._store, self._snapshot, self._version = store, snapshot, version
        self._enabled = enabled
        self._every = every if enabled else 0
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._last = version()
        self._thread = threading.Thread(target=self._watch, name="shardline-checkpointer", daemon=True)
        self.saved: list[int] = []

    def __enter__(self) -> "Checkpointer":
        if self._every:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def save(self, why: str, periodic: bool = False) -> None:
        """Best effort: a failing checkpoint write is logged, never allowed to stop training."""
        if not self._enabled:
            return
        with self._lock:
            try:
                state = self._snapshot()
                info = self._store.save(state)
                self._last = state["step"]
                self.saved.append(state["step"])
                log.info("checkpoint at step %d (%s): %s", state["step"], why, info.path)
            except SnapshotNotReady as why_not:
                # Periodic saves retry at the next poll; a skipped request leaves the previous checkpoint.
                log.log(logging.DEBUG if periodic else logging.INFO, "checkpoint (%s) skipped: %s", why, why_not)
            except Exception:
                log.warning("could not write a checkpoint (%s) to %s", why, self._store.directory, exc_info=True)

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            if self._version() - self._last >= self._every:
                self.save(f"every {self._every} steps", periodic=True)


def own_latest(store: CheckpointStore, launch_id: str, fallback: Optional[CheckpointInfo]) -> Optional[CheckpointInfo]:
    """The newest checkpoint written by the launch ``launch_id``, else ``fallback``."""
    latest = store.latest()
    if latest is None:
        return fallback
    try:
        own = store.load(latest).get("launch_id") == launch_id
    except Exception:  # unreadable: fall back rather than fail the retry
        log.warning("could not read checkpoint %s to resume the retry", latest.path, exc_info=True)
        own = False
    return latest if own else fallback
