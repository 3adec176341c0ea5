"""The scheduled workflow: incremental ETL over a date-partitioned source, training, champion/challenger.

State (state.json beside the shards) records each processed partition's input fingerprint (file names,
sizes, modification times), the statistics and labels frozen at the first partition, and the set of
partitions the last model was trained on. A rerun on unchanged input does no work and says so; a new or
changed partition is ETL'd alone, then the model is trained on all partitions together (workflow.train_on:
or the new one only) and promoted only if it beats the champion on the same test data.

A Delta or Iceberg source has no partition folders: its versions are the partitions. The rows appended
since the version last prepared are ETL'd alone as the new partition; a commit that removed or changed
files (a delete, update, overwrite) prepares every row again, from a fresh fit (pipeline/tables/changes.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pipeline.config.features import is_plain
from pipeline.config.schema import PipelineConfig
from pipeline.config.workdir import Workdir
from pipeline.errors import ConfigError, DataError
from pipeline.shards import Manifest, load_manifest
from pipeline.steps import Promotion

log = logging.getLogger(__name__)


@dataclass
class WorkflowOutcome:
    did_work: bool
    reason: str
    partitions: list[str]
    processed: list[str] = field(default_factory=list)
    run_id: Optional[str] = None
    test_metrics: dict = field(default_factory=dict)
    promotion: Optional[Promotion] = None


@dataclass
class WorkflowState:
    path: Path
    partitions: dict = field(default_factory=dict)  # value -> {"fingerprint", "rows", "shards"}
    means: Optional[list] = None
    stds: Optional[list] = None
    labels: Optional[list] = None
    trained_on: Optional[str] = None  # key of the partition set the last model saw
    fitted_by: Optional[str] = None  # typed features: the shard set whose fit (vocabularies, statistics) is frozen
    table: Optional[dict] = None  # a Delta/Iceberg source: {"format", "name", "version"} last prepared

    @classmethod
    def load(cls, folder: Path) -> "WorkflowState":
        path = folder / "state.json"
        if not path.exists():
            return cls(path)
        try:
            data = json.loads(path.read_text())
            return cls(path, data["partitions"], data.get("means"), data.get("stds"), data.get("labels"),
                       data.get("trained_on"), data.get("fitted_by"), data.get("table"))
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(f"workflow state {path} is unreadable ({exc}); delete it to reprocess everything") from None

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"partitions": self.partitions, "means": self.means, "stds": self.stds, "labels": self.labels,
                "trained_on": self.trained_on, "fitted_by": self.fitted_by, "table": self.table}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".state-", suffix=".json")
        with os.fdopen(fd, "w") as out:
            json.dump(data, out, indent=2)  # partitions in the order prepared
        os.replace(tmp, self.path)


def state_dir(cfg: PipelineConfig) -> Path:
    return Workdir.of(cfg).workflow_state


def discover(root: Path, column: str) -> dict[str, str]:
    """{partition value: fingerprint of its files} for every `<column>=<value>` folder under root."""
    if not root.is_dir():
        raise DataError(f"data.path {root} is not a folder; the workflow reads a source partitioned into "
                        f"{column}=<value> folders (workflow.partition_column)")
    found = {}
    for folder in sorted(root.glob(f"{column}=*")):
        if not folder.is_dir():
            continue
        digest = hashlib.sha256()
        for file in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith((".", "_"))):
            stat = file.stat()
            digest.update(f"{file.relative_to(folder)}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
        found[folder.name.split("=", 1)[1]] = "sha256:" + digest.hexdigest()
    if not found:
        raise DataError(f"no {column}=<value> partition folders under {root}; set workflow.partition_column "
                        "or point data.path at the partitioned source")
    return found


def _partition_key(found: dict[str, str]) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(found, sort_keys=True).encode()).hexdigest()


def _prepare(spark, cfg: PipelineConfig, state: WorkflowState, shards_dir, data: dict, pinned=None) -> Manifest:
    """ETL one partition into `shards_dir` (`data`: its data.* changes) with the frozen fit, freezing it at
    the first partition: every later one is scaled and labelled alike."""
    from pipeline.etl import run_etl

    part_cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={
        **data, "shards_dir": str(shards_dir),
        "classes": state.labels if state.labels is not None else cfg.data.classes})})
    statistics = (state.means, state.stds) if state.means is not None else None
    if state.fitted_by is not None:  # typed features: the whole fit of the first partition
        statistics = load_manifest(state.fitted_by)
    manifest = run_etl(spark, part_cfg, statistics=statistics, pinned=pinned)
    if state.means is None:
        state.means, state.stds = list(manifest.means), list(manifest.stds)
        if not is_plain(cfg.data.features):
            state.fitted_by = manifest.root
        state.labels = list(manifest.label_mapping) if manifest.label_mapping is not None else None
    return manifest


def run_workflow(spark, cfg: PipelineConfig) -> WorkflowOutcome:
    """One scheduled run: ETL new partitions, train on all of them, evaluate, promote or not."""
    if cfg.data.source in ("delta", "iceberg"):
        return _run_table_workflow(spark, cfg)
    if not cfg.data.path or cfg.data.source not in ("parquet", "csv"):
        raise ConfigError("the workflow needs data.source=parquet or csv and data.path pointing at a source "
                          f"partitioned into {cfg.workflow.partition_column}=<value> folders, or a Delta or "
                          "Iceberg table (data.source=delta|iceberg)")
    column = cfg.workflow.partition_column
    root = Path(cfg.data.path)
    workdir = Workdir.of(cfg)
    state = WorkflowState.load(workdir.workflow_state)
    found = discover(root, column)
    key = _partition_key(found)
    todo = [v for v in found if state.partitions.get(v, {}).get("fingerprint") != found[v]]
    if not todo and state.trained_on == key:
        reason = (f"nothing to do: all {len(found)} partition(s) of {root} are unchanged since the last run "
                  f"and the current model was trained on exactly them (inputs {key[:19]}...)")
        log.info("%s", reason)
        return WorkflowOutcome(False, reason, sorted(found))
    for value in todo:
        manifest = _prepare(spark, cfg, state, workdir.shard_partition(column, value),
                            {"path": str(root / f"{column}={value}")})
        state.partitions[value] = {"fingerprint": found[value], "rows": manifest.etl_report.get("output_rows"),
                                   "shards": manifest.root}
        state.save()  # per partition: a crash later redoes only what is missing
        log.info("workflow: partition %s=%s processed", column, value)
    for gone in sorted(set(state.partitions) - set(found)):
        log.warning("workflow: partition %s=%s is no longer in %s; training without it", column, gone, root)
        del state.partitions[gone]
    trained = todo if cfg.workflow.train_on == "new" and todo else sorted(found)
    outcome = _train_partitions(spark, cfg, state, [workdir.shard_partition(column, v) for v in trained], todo)
    state.trained_on = key
    state.save()
    return dataclasses.replace(outcome, partitions=sorted(found),
                               reason=f"processed {len(todo)} new/changed partition(s) {todo}; trained on "
                                      f"{len(trained)} partition(s); {outcome.promotion.reason}")


def _run_table_workflow(spark, cfg: PipelineConfig) -> WorkflowOutcome:
    """The workflow over a Delta/Iceberg table's versions: the rows appended since the last run are the new
    partition; a non-append commit prepares every row again; no new version does nothing."""
    from pipeline.tables.changes import changes_since

    workdir = Workdir.of(cfg)
    state = WorkflowState.load(workdir.workflow_state)
    same_table = state.table is not None and (state.table["format"], state.table["name"]) == (cfg.data.source,
                                                                                              cfg.data.path)
    change = changes_since(cfg.data, state.table["version"] if same_table else None)
    now = change.pinned
    if change.kind == "none" and state.trained_on == _partition_key(
            {v: p["fingerprint"] for v, p in state.partitions.items()}):
        reason = f"nothing to do: {change.reason} of {now.name}, and the current model was trained on it"
        log.info("%s", reason)
        return WorkflowOutcome(False, reason, list(state.partitions))
    todo = []
    if change.kind != "none":
        log.info("workflow: %s", change.reason)
        if change.kind == "rewrite":  # every row again, from a fresh fit (the old statistics saw deleted rows)
            for gone in state.partitions.values():
                _remove_shards(gone["shards"])
            state = WorkflowState(state.path)
        value = str(now.version)
        manifest = _prepare(spark, cfg, state, workdir.shard_partition("version", value), {}, pinned=now)
        state.partitions[value] = {"fingerprint": f"{now.format}:{now.version}:{change.kind}",
                                   "rows": manifest.etl_report.get("output_rows"), "shards": manifest.root}
        state.table = {"format": now.format, "name": now.name, "version": now.version}
        state.save()
        todo = [value]
    found = list(state.partitions)  # in the order prepared (state.json keeps it)
    trained = todo if cfg.workflow.train_on == "new" and todo else found
    outcome = _train_partitions(spark, cfg, state, [state.partitions[v]["shards"] for v in trained], todo)
    state.trained_on = _partition_key({v: p["fingerprint"] for v, p in state.partitions.items()})
    state.save()
    return dataclasses.replace(outcome, partitions=found,
                               reason=f"{change.reason}; trained on {len(trained)} partition(s) up to "
                                      f"{now.describe()}; {outcome.promotion.reason}")


def _remove_shards(root: str) -> None:
    """A partition's shard set that no run trains on again (a full re-ETL replaced it)."""
    import shutil

    from pipeline import storage

    if storage.is_remote(root):
        storage.delete_dir(root)
    else:
        shutil.rmtree(root, ignore_errors=True)
    log.info("workflow: removed the replaced partition's shards %s", root)


def _train_partitions(spark, cfg: PipelineConfig, state: WorkflowState, folders: list, todo: list[str]):
    """Train on the partitions' shard sets merged, under the workflow's own MLflow run; promote or not."""
    from pipeline.shards.merge import merge_manifests

    parts = [load_manifest(folder) for folder in folders]
    merged = merge_manifests(parts, Workdir.of(cfg).shards, cfg.name)
    with _parent_run(cfg) as parent:
        parent.set_tags({"shardline.workflow.processed": ",".join(todo) or "-",
                         "shardline.workflow.partitions": str(len(parts)), "shardline.fingerprint": merged.fingerprint})
        outcome = train_and_promote(spark, cfg, merged, processed=todo, parent_run_id=parent.run_id)
        parent.log_metrics({f"test_{k}": v for k, v in outcome.test_metrics.items()})
        parent.set_tags({"shardline.promotion": outcome.promotion.alias,
                         "shardline.promotion_reason": outcome.promotion.reason,
                         "shardline.registered_version": outcome.promotion.version})
    return outcome


def _parent_run(cfg: PipelineConfig):
    """The workflow's own MLflow run; training/evaluation/promotion is a nested run under it."""
    from pipeline.steps import tracking_uri
    from pipeline.tracking import start_run

    return start_run(tracking_uri(cfg), cfg.tracking.experiment, f"workflow {cfg.name}")


def train_and_promote(spark, cfg: PipelineConfig, manifest: Manifest, processed: list[str],
                      parent_run_id: Optional[str] = None) -> WorkflowOutcome:
    from pipeline import steps

    initial = None
    if cfg.workflow.warm_start:
        champion = steps.champion_model(spark, cfg)
        if champion is not None:
            initial = champion[1]
            log.info("workflow: warm start from the champion's parameters")
    # Registration is the promotion step's job, not log_model's.
    train_cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"registered_model": None})})
    tags = {"shardline.workflow.processed": ",".join(processed) or "-"}
    if parent_run_id:
        tags["shardline.workflow.run_id"] = parent_run_id
    outcome = steps.train_and_evaluate(spark, train_cfg, manifest, initial_parameters=initial, tags=tags)
    promotion = steps.promote(spark, cfg, manifest, outcome.run_id, outcome.model_uri)
    return WorkflowOutcome(True, "", [], processed, outcome.run_id, outcome.test_metrics, promotion)
