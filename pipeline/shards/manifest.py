"""The shard manifest: what a shard set holds, read without touching the data.

manifest.json sits at the root of a shard set and is the only way the rest of the pipeline finds
shards: per-split, per-shard file lists with row counts, the feature schema, train-split statistics,
the label mapping and a content fingerprint. On an object store the shard files live under a fresh
per-ETL prefix the manifest names (`data_prefix`, see pipeline/shards/publish.py).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from pipeline import storage
from pipeline.errors import ManifestError

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class ShardFile:
    path: str  # relative to the shard-set root
    rows: int
    bytes: int
    # Rows of each Parquet row group, in file order: a rank's read plan needs no footer or data read.
    row_groups: tuple[int, ...] = ()


@dataclass(frozen=True)
class Shard:
    index: int
    rows: int
    files: tuple[ShardFile, ...]


@dataclass(frozen=True)
class SplitShards:
    rows: int
    shards: tuple[Shard, ...]


@dataclass(frozen=True)
class Manifest:
    name: str
    task: str
    feature_columns: tuple[str, ...]
    label_column: str
    label_mapping: Optional[tuple[str, ...]]
    standardized: bool
    means: tuple[float, ...]
    stds: tuple[float, ...]
    splits: dict[str, SplitShards]
    fingerprint: str
    etl_report: dict[str, Any] = field(default_factory=dict)
    features_field: str = "features"
    label_field: str = "label"
    format_version: int = FORMAT_VERSION
    # The fitted feature spec (FeatureSpec dicts, in configuration order); empty on classic numeric-only
    # shard sets written before typed features, which `feature_set` then describes from the columns above.
    features: tuple[dict, ...] = ()
    # Object stores: the folder below the root that holds this set's files (each ETL writes a fresh one
    # and publishes the manifest last); "" for local sets, whose files sit at the root.
    data_prefix: str = ""
    root: str = ""  # where it was loaded from; not serialized

    @property
    def data_root(self) -> str:
        """Where the files listed in the manifest (and the vocabularies) are, relative paths joined to it."""
        return storage.join(self.root, self.data_prefix) if self.data_prefix else self.root

    @property
    def feature_set(self):
        """The features as a FeatureSet (what models are built from and the loader batches hold)."""
        from pipeline.config.feature_spec import FeatureSet

        if self.features:
            return FeatureSet.from_list(self.features)
        return FeatureSet.numeric_only(self.feature_columns, self.means, self.stds, self.standardized)

    def vocabulary(self, name: str):
        """The learned vocabulary of categorical/text feature `name` as an Arrow string array (id = 2 + position)."""
        import pyarrow.parquet as pq

        spec = self.feature_set[name]
        if not spec.vocabulary:
            raise ManifestError(f"feature {name!r} of {self.root or self.name} has no vocabulary ({spec.type}"
                                f"{', hash buckets' if spec.hash_buckets else ''})")
        path = storage.join(self.data_root, spec.vocabulary)
        try:
            fs, inside = storage.resolve(path)
            return pq.read_table(inside, columns=["value"], filesystem=fs).column("value").combine_chunks()
        except (OSError, KeyError) as exc:
            raise ManifestError(f"cannot read the vocabulary of feature {name!r} at {path}: {exc}; "
                                "re-run `shardline etl`") from None

    def vocabularies(self) -> dict:
        """name -> vocabulary array, for every feature that has one."""
        return {f.name: self.vocabulary(f.name) for f in self.feature_set if f.vocabulary}

    def vocabulary_files(self) -> dict[str, str]:
        """name -> absolute path of its vocabulary file."""
        return {f.name: storage.join(self.data_root, f.vocabulary) for f in self.feature_set if f.vocabulary}

    @property
    def num_features(self) -> int:
        return len(self.feature_columns)

    @property
    def num_classes(self) -> Optional[int]:
        return len(self.label_mapping) if self.label_mapping is not None else None

    def split(self, name: str) -> SplitShards:
        try:
            return self.splits[name]
        except KeyError:
            raise ManifestError(f"shard set {self.root or self.name} has no {name!r} split "
                                f"(it has {sorted(self.splits)}); re-run `shardline etl`") from None

    def files(self, split: str, shard: Optional[int] = None) -> list[str]:
        """Absolute paths of one shard's files, or of the whole split."""
        chosen = self.split(split).shards if shard is None else [self.split(split).shards[shard]]
        return [storage.join(self.data_root, f.path) for s in chosen for f in s.files]

    def row_group_rows(self, split: str, shard: Optional[int] = None) -> list[list[int]]:
        """Per file of `files(split, shard)`, the rows of each row group (empty lists for old manifests)."""
        chosen = self.split(split).shards if shard is None else [self.split(split).shards[shard]]
        return [list(f.row_groups) for s in chosen for f in s.files]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("root")
        return data

    def write(self, directory: str | os.PathLike) -> str:
        """Write manifest.json atomically: one PUT on an object store (the object appears whole), a
        temporary file renamed into place locally."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if storage.is_remote(directory):
            path = storage.join(directory, MANIFEST_NAME)
            storage.write_bytes(path, text.encode())
            return path
        path = Path(directory) / MANIFEST_NAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        return str(path)


def _split_from_dict(data: dict[str, Any]) -> SplitShards:
    shards = tuple(
        Shard(index=s["index"], rows=s["rows"], files=tuple(ShardFile(**{**f, "row_groups": tuple(f.get("row_groups", ()))}) for f in s["files"]))
        for s in data["shards"])
    return SplitShards(rows=data["rows"], shards=shards)


def load_manifest(directory: str | os.PathLike) -> Manifest:
    """Read and check a shard set's manifest; errors say which file and what to do."""
    remote = storage.is_remote(directory)
    root = str(directory).rstrip("/") if remote else Path(directory)
    path = storage.join(root, MANIFEST_NAME) if remote else root / MANIFEST_NAME
    try:
        text = storage.read_bytes(path).decode() if remote else path.read_text()
    except FileNotFoundError:
        raise ManifestError(f"no shard manifest at {path}; run `shardline etl` (or the etl job) first") from None
    try:
        data = json.loads(text)
        if data.get("format_version") != FORMAT_VERSION:
            raise ManifestError(f"{path} has format_version {data.get('format_version')}, this shardline reads "
                                f"{FORMAT_VERSION}; re-run `shardline etl`")
        manifest = Manifest(
            name=data["name"], task=data["task"], feature_columns=tuple(data["feature_columns"]),
            label_column=data["label_column"],
            label_mapping=tuple(data["label_mapping"]) if data["label_mapping"] is not None else None,
            standardized=data["standardized"], means=tuple(data["means"]), stds=tuple(data["stds"]),
            splits={name: _split_from_dict(s) for name, s in data["splits"].items()},
            fingerprint=data["fingerprint"], etl_report=data.get("etl_report", {}),
            features_field=data["features_field"], label_field=data["label_field"],
            features=tuple(data.get("features") or ()), data_prefix=data.get("data_prefix", ""), root=str(root))
    except ManifestError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"{path} is not a valid shard manifest ({type(exc).__name__}: {exc}); "
                            "re-run `shardline etl`") from None
    missing = _missing_files(manifest)
    if missing:
        raise ManifestError(f"{len(missing)} shard file(s) listed in {path} are missing, e.g. {missing[0]}; "
                            "re-run `shardline etl`")
    return manifest


def _missing_files(manifest: Manifest) -> list[str]:
    listed = [f for name in manifest.splits for f in manifest.files(name)]
    if not storage.is_remote(manifest.root):
        return [f for f in listed if not os.path.exists(f)]
    # One listing of the set's prefix instead of a HEAD request per file.
    present = set(storage.list_files(manifest.data_root)) if listed else set()
    return [f for f in listed if storage.resolve(f)[1] not in present]


def fingerprint_files(root: str | os.PathLike, relative_paths: list[str], header: dict[str, Any]) -> str:
    """sha256 over the manifest's content-defining fields and every shard file's bytes, in a fixed order.

    File names (which carry a random write id) are left out, so the same data gives the same fingerprint,
    on any store (`root` a local path or a URL).
    """
    digest = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    fs, base = storage.resolve(root)
    for rel in sorted(relative_paths):
        digest.update(os.path.dirname(rel).encode())
        with fs.open_input_stream(f"{base}/{rel}") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()
