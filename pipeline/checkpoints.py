"""Durable training checkpoints: the PS state plus what a resumed run must agree with.

One file per checkpoint, `ckpt-<step>.pt`, written to a temporary name and renamed into place, so a
reader never sees a half-written one; the newest `keep` are kept. The directory is a local path or any
fsspec URL (s3://, gs://, abfss://, dbfs:/...). On an object store (no rename: fsspec's mv is a full
copy) the file is written under its final name directly: a PUT (multipart or not) becomes visible only
whole, on close, which is the atomicity the rename gives locally; the digest is still committed first. Files are torch.save'd dicts of tensors and plain
values and are loaded with weights_only=True: a checkpoint can never run code.

A checkpoint may be a *set* (``ps.placement: hosts``): each server shard wrote its own part as
`parts/<token>-shard-<i>-of-<K>.pt` (``pipeline.ps.state.part_file``), and the checkpoint file records the
parts' SHA-256 digests and versions instead of the parameters. ``load`` verifies each part against its
recorded digest before unpickling it and merges them (``merge_parts``, given by whoever opens the store),
so a set loads as the same state a single file holds; parts move and are pruned with their checkpoint.

Each checkpoint has a digest file next to it, `ckpt-<step>.pt.sha256`, committed before the checkpoint
itself and checked before a byte is unpickled: HMAC-SHA256 of the file under `$SHARDLINE_ARTIFACT_KEY`
when set (tampering needs the key), else SHA-256 (catches corruption and partial copies). What model a
resumed run builds is the config's, never the checkpoint's (launch/train.py checks the recorded factory
against model.allowed_factories before comparing the rest).
"""
from __future__ import annotations

import hashlib
import hmac
import io
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Optional

from pipeline.errors import ConfigError, PSError

log = logging.getLogger(__name__)

FORMAT = 1
_NAME = re.compile(r"ckpt-(\d{12})\.pt$")
DIGEST_SUFFIX = ".sha256"
# The same variable as pipeline.models.trust (checkpoints import nothing of the pipeline but errors).
KEY_ENV = "SHARDLINE_ARTIFACT_KEY"


def file_digest(data: bytes) -> str:
    """``hmac-sha256:<hex>`` under $SHARDLINE_ARTIFACT_KEY when set, else ``sha256:<hex>``."""
    key = os.environ.get(KEY_ENV)
    if key:
        return "hmac-sha256:" + hmac.new(key.encode("utf-8"), data, hashlib.sha256).hexdigest()
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _renames(fs) -> bool:
    """Whether `fs` has an atomic rename (local disks, mounts, HDFS) rather than copy + delete (object stores)."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    return bool(protocols & {"file", "local", "hdfs", "viewfs", "dbfs"})


_PART_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def part_names(state: dict[str, Any], path: str) -> list[str]:
    """The part files a checkpoint's ``ps`` record names, each a plain file name (never a path out of
    ``parts/``: the names come from a file anyone who can write the folder could have written)."""
    names = [str(p.get("file", "")) for p in (state.get("ps") or {}).get("parts") or ()]
    for name in names:
        if not _PART_NAME.fullmatch(name) or ".." in name:
            raise ConfigError(f"checkpoint {path} names a part {name!r} that is not a plain file name; refusing it")
    return names


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    step: int


class CheckpointStore:
    """Save, list, load and prune the checkpoints of one run in `directory`. ``merge_parts(parts, record)``:
    the PS state of a checkpoint set from its loaded parts (in shard order) and its ``ps`` record."""

    def __init__(self, directory: str, keep: int = 3,
                 merge_parts: Optional[Callable[[list, dict], dict]] = None):
        from fsspec.core import url_to_fs

        directory = directory.rstrip("/")
        # Shards on other hosts (and other working directories) write the parts: a local path is made absolute.
        self.directory = directory if "://" in directory or directory.startswith("dbfs:") else os.path.abspath(directory)
        self.keep = keep
        self._merge_parts = merge_parts
        self._part_files: dict[str, list[str]] = {}  # checkpoint path -> the part files it names
        self._fs, self._root = url_to_fs(self.directory)
        # Object stores publish an object atomically when its write completes; local and mounted
        # filesystems need the temporary name + rename.
        self._atomic_put = not _renames(self._fs)

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first."""
        self._fs.invalidate_cache(self._root)  # another process (a task-hosted PS, a resumed run) may have written
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
            self._move(info.path, archive)
        return len(found)

    @property
    def parts_directory(self) -> str:
        """Where the server shards write the parts of a checkpoint set (a local path or a URL, as given)."""
        return f"{self.directory}/parts"

    def _parts_of(self, path: str) -> Optional[list[str]]:
        """The part files the checkpoint at ``path`` names: none for a single file (and nothing is read
        while no part was ever written here), None when it cannot be read (its parts, if any, are left)."""
        if path in self._part_files:
            return self._part_files[path]
        if not self._fs.exists(f"{self._root}/parts"):
            return []
        try:
            names = part_names(self._read(CheckpointInfo(path, 0)), path)
        except Exception:  # unreadable (another key, a broken read): never guess that it names nothing
            log.warning("could not read checkpoint %s to find its parts; they stay where they are", path,
                        exc_info=True)
            return None
        self._part_files[path] = names
        return names

    def discard_parts(self, prefix: str) -> None:
        """Delete the parts whose names start with ``prefix`` (a snapshot that was never committed)."""
        folder = f"{self._root}/parts"
        self._fs.invalidate_cache(folder)
        if self._fs.exists(folder):
            for path in self._fs.ls(folder, detail=False):
                if str(path).rsplit("/", 1)[-1].startswith(prefix):
                    self._fs.rm(path)

    def _move(self, path: str, folder: str) -> None:
        """A checkpoint, its digest and its parts into ``folder``."""
        for name in self._parts_of(path) or ():
            self._fs.makedirs(f"{folder}/parts", exist_ok=True)
            if self._fs.exists(f"{self._root}/parts/{name}"):
                self._fs.mv(f"{self._root}/parts/{name}", f"{folder}/parts/{name}")
        self._fs.mv(path, f"{folder}/{path.rsplit('/', 1)[-1]}")
        if self._fs.exists(path + DIGEST_SUFFIX):
            self._fs.mv(path + DIGEST_SUFFIX, f"{folder}/{path.rsplit('/', 1)[-1]}{DIGEST_SUFFIX}")
        self._part_files.pop(path, None)

    def set_aside_after(self, step: int, folder: str = "after_best") -> int:
        """Move checkpoints past ``step`` into ``folder/`` (early stopping / the divergence guard keep an
        earlier epoch: a --resume must continue from it, not from the states after it). Returns how many."""
        later = [info for info in self.list() if info.step > step]
        if later:
            self._fs.makedirs(f"{self._root}/{folder}", exist_ok=True)
        for info in later:
            self._move(info.path, f"{self._root}/{folder}")
        return len(later)

    def latest(self) -> Optional[CheckpointInfo]:
        found = self.list()
        return found[-1] if found else None

    def save(self, state: dict[str, Any]) -> CheckpointInfo:
        """Write `state` (must hold "step") atomically, then drop all but the newest `keep`."""
        import torch

        step = int(state["step"])
        names = part_names(state, f"ckpt-{step:012d}.pt")  # a set names plain files in parts/, or nothing
        buffer = io.BytesIO()
        torch.save({**state, "format": FORMAT, "saved_at": time.time()}, buffer)
        self._fs.makedirs(self._root, exist_ok=True)
        final = f"{self._root}/ckpt-{step:012d}.pt"
        temporary = f"{self._root}/.ckpt-{step:012d}.pt.{uuid.uuid4().hex[:8]}.tmp"
        data = buffer.getvalue()
        # The digest is committed first: a checkpoint visible under its final name always has one.
        if self._atomic_put:
            with self._fs.open(final + DIGEST_SUFFIX, "w") as out:
                out.write(file_digest(data))
            with self._fs.open(final, "wb") as out:
                out.write(data)
        else:
            with self._fs.open(temporary + DIGEST_SUFFIX, "w") as out:
                out.write(file_digest(data))
            self._fs.mv(temporary + DIGEST_SUFFIX, final + DIGEST_SUFFIX)
            with self._fs.open(temporary, "wb") as out:
                out.write(data)
            self._fs.mv(temporary, final)
        self._part_files[final] = names
        for old in self.list()[:-self.keep]:
            for name in self._parts_of(old.path) or ():  # an unreadable one's parts are left, not guessed at
                if self._fs.exists(f"{self._root}/parts/{name}"):
                    self._fs.rm(f"{self._root}/parts/{name}")
            self._part_files.pop(old.path, None)
            self._fs.rm(old.path)
            if self._fs.exists(old.path + DIGEST_SUFFIX):
                self._fs.rm(old.path + DIGEST_SUFFIX)
        log.debug("checkpoint at step %d: %s (%d bytes)", step, final, buffer.tell())
        return CheckpointInfo(final, step)

    def load(self, info: CheckpointInfo, *, parts: bool = True) -> dict[str, Any]:
        """The checkpoint's state; a set's parts are read and merged when the store was opened with
        ``merge_parts`` and ``parts`` is True (else ``ps`` stays the record naming the parts: enough for
        the checkpoint's metadata, and nothing of the parameters is read)."""
        state = self._read(info)
        record = state.get("ps")
        if isinstance(record, dict) and record.get("parts") and parts and self._merge_parts is not None:
            state = {**state, "ps": self._load_parts(info, record)}
        return state

    def _load_parts(self, info: CheckpointInfo, record: dict) -> dict[str, Any]:
        """The PS state of a checkpoint set: each part verified against the digest the checkpoint records."""
        import torch

        folder = info.path.rsplit("/", 1)[0] + "/parts"
        parts = []
        for name, part in zip(part_names({"ps": record}, info.path), record["parts"]):
            path = f"{folder}/{name}"
            try:
                with self._fs.open(path, "rb") as f:
                    raw = f.read()
            except FileNotFoundError:
                raise ConfigError(f"checkpoint {info.path} names the part {path}, which is missing: delete the "
                                  "checkpoint to resume from the one before, or start without --resume") from None
            if not hmac.compare_digest("sha256:" + hashlib.sha256(raw).hexdigest(), str(part["digest"])):
                raise ConfigError(f"checkpoint part {path} does not match the digest its checkpoint {info.path} "
                                  "records: corrupt or tampered with; delete the checkpoint to resume from the one "
                                  "before, or start without --resume")
            parts.append(torch.load(io.BytesIO(raw), weights_only=True))
        return self._merge_parts(parts, {k: v for k, v in record.items() if k != "parts"})

    def _read(self, info: CheckpointInfo) -> dict[str, Any]:
        import torch

        with self._fs.open(info.path, "rb") as f:
            raw = f.read()
        self._verify(info, raw)
        data = io.BytesIO(raw)
        try:
            state = torch.load(data, weights_only=True)
        except Exception as exc:
            raise ConfigError(f"checkpoint {info.path} cannot be read ({type(exc).__name__}: {exc}); delete it to "
                              "resume from the one before, or start without --resume") from None
        if state.get("format") != FORMAT:
            raise ConfigError(f"checkpoint {info.path} has format {state.get('format')}, this shardline reads "
                              f"{FORMAT}; start without --resume")
        return state

    def _verify(self, info: CheckpointInfo, raw: bytes) -> None:
        """Refuse a checkpoint whose digest file is missing or does not match, before unpickling it."""
        try:
            with self._fs.open(info.path + DIGEST_SUFFIX, "r") as f:
                recorded = f.read().strip()
        except FileNotFoundError:
            raise ConfigError(f"checkpoint {info.path} has no digest file ({info.path}{DIGEST_SUFFIX}: written "
                              "before digests, or removed); refusing to load it: delete it to resume from the one "
                              "before, or start without --resume") from None
        if recorded.startswith("hmac-sha256:") and not os.environ.get(KEY_ENV):
            raise ConfigError(f"checkpoint {info.path} is signed with a key (hmac-sha256) but ${KEY_ENV} is not set; "
                              "set it to the key the run was started with")
        if not hmac.compare_digest(file_digest(raw), recorded):
            raise ConfigError(f"checkpoint {info.path} does not match its digest ({info.path}{DIGEST_SUFFIX}): "
                              f"corrupt, tampered with, or written under another ${KEY_ENV}; refusing to load it: "
                              "delete it to resume from the one before, or start without --resume")


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
    # Where the run's steps fall in its epochs (pipeline.data.assignment.StreamPlan.record()): what a resume
    # with another parallelism.data re-cuts the interrupted epoch from. None in checkpoints made before it.
    stream: Optional[dict] = None

    def for_launch(self, launch_id: str) -> "CheckpointMeta":
        return replace(self, launch_id=launch_id)

    def record(self) -> dict[str, Any]:
        """The plain values stored in the checkpoint file."""
        values = asdict(self)
        for key in ("launch_id", "stream"):
            if values[key] is None:
                del values[key]
        return values


def check_compatible(state: dict[str, Any], path: str, *, fingerprint: str, model: dict, mode: str) -> None:
    """Refuse to resume a checkpoint that belongs to other data, another model or another ps.mode. The
    worker count and batch size may change (launch/elastic.py decides what a change needs)."""
    problems = []
    if state["fingerprint"] != fingerprint:
        problems.append(f"it was trained on shard set {state['fingerprint']}, the shards now are {fingerprint} "
                        "(re-run on the same shards, or start fresh)")
    if state["model"] != model:
        problems.append(f"its model is {state['model']}, the config now builds {model} (use the same model.* "
                        "settings, or start fresh)")
    if state["mode"] != mode:
        problems.append(f"it ran ps.mode={state['mode']}, the config says {mode}")
    if problems:
        raise ConfigError(f"cannot resume from checkpoint {path}: " + "; ".join(problems))


class SnapshotNotReady(Exception):
    """The state to checkpoint is not consistent yet (e.g. the PS is ahead of the epoch reports that go with
    it); a periodic save retries at its next poll, a requested one is skipped."""


class Checkpointer:
    """Saves ``snapshot()`` to ``store`` from a background thread when either pace is due: ``every`` steps
    of ``version()`` since the last checkpoint, or ``every_s`` seconds of ``clock`` (with at least one new
    step); and on request. Runs wherever the PS runs (the driver, or rank 0's task).

    A periodic checkpoint is a DEBUG line; ``summary()`` gives the INFO line per epoch (a step pace wrote
    110 INFO lines, four a second, in a 16M-row epoch: issue 47)."""

    def __init__(self, store: CheckpointStore, snapshot: Callable[[], dict], version: Callable[[], int], every: int,
                 poll_s: float = 0.1, enabled: bool = True, every_s: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic):
        self._store, self._snapshot, self._version = store, snapshot, version
        self._enabled = enabled
        self._every = every if enabled else 0
        self._every_s = every_s if enabled and every_s else None
        self._poll_s = poll_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._last = version()
        self._last_at = clock()
        self._thread = threading.Thread(target=self._watch, name="shardline-checkpointer", daemon=True)
        self.saved: list[int] = []
        self._unsummarized: list[tuple[int, str]] = []  # (step, path) since the last summary()

    def __enter__(self) -> "Checkpointer":
        if self._every or self._every_s:
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
                self._last, self._last_at = state["step"], self._clock()
                self.saved.append(state["step"])
                self._unsummarized.append((state["step"], str(info.path)))
                log.log(logging.DEBUG if periodic else logging.INFO, "checkpoint at step %d (%s): %s", state["step"],
                        why, info.path)
            except SnapshotNotReady as why_not:
                # Periodic saves retry at the next poll; a skipped request leaves the previous checkpoint.
                log.log(logging.DEBUG if periodic else logging.INFO, "checkpoint (%s) skipped: %s", why, why_not)
            except PSError as exc:  # the server failed (a lost shard names itself): the attempt's error says more
                log.warning("could not take a checkpoint (%s): %s", why, exc)
            except Exception:
                log.warning("could not write a checkpoint (%s) to %s", why, self._store.directory, exc_info=True)

    def due(self) -> Optional[str]:
        """Why a periodic checkpoint is due now (None: it is not)."""
        steps = self._version() - self._last
        if self._every and steps >= self._every:
            return f"every {self._every} steps"
        if self._every_s and steps > 0 and self._clock() - self._last_at >= self._every_s:
            return f"every {self._every_s:g}s"
        return None

    def poll(self) -> None:
        """One look of the background thread: save if a pace is due."""
        why = self.due()
        if why is not None:
            self.save(why, periodic=True)

    def summary(self) -> Optional[str]:
        """The checkpoints written since the last summary, as one line (None: none), logged at INFO."""
        with self._lock:
            written, self._unsummarized = self._unsummarized, []
        if not written:
            return None
        line = (f"{len(written)} checkpoint(s) since the last epoch line, the newest at step {written[-1][0]}: "
                f"{written[-1][1]}")
        log.info(line)
        return line

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            self.poll()


def own_latest(store: CheckpointStore, launch_id: str, fallback: Optional[CheckpointInfo]) -> Optional[CheckpointInfo]:
    """The newest checkpoint written by the launch ``launch_id``, else ``fallback``."""
    latest = store.latest()
    if latest is None:
        return fallback
    try:
        own = store.load(latest, parts=False).get("launch_id") == launch_id
    except Exception:  # unreadable: fall back rather than fail the retry
        log.warning("could not read checkpoint %s to resume the retry", latest.path, exc_info=True)
        own = False
    return latest if own else fallback
