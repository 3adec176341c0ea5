"""The fitted feature spec: what the ETL learned for each feature, as plain values.

It is written into the shard manifest, crosses into Spark tasks inside the model spec, is what a
``model.factory`` is called with, and (as JSON) is what the served MLflow model preprocesses raw rows
with. Plain dataclasses of numbers and strings only, so ``to_dict``/``from_dict`` round-trip through JSON.

Batch layout (what the loader yields and models take): ``batch['numeric']`` float32 [B, numeric_width]
holds every numeric feature (and each imputed feature's is-missing flag right after it), in spec order;
every other feature is ``batch[name]``: categorical int64 [B], vector float32 [B, length], image uint8
[B, channels, height, width], text int64 [B, max_len] plus ``batch[name + '__len']`` int64 [B].
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterator, Optional

NUMERIC_KEY = "numeric"
LENGTH_SUFFIX = "__len"
# Shard columns of non-numeric features are "f__<name>", so no feature can collide with "features"/"label".
COLUMN_PREFIX = "f__"
NULL_ID, OOV_ID, FIRST_ID = 0, 1, 2


@dataclass(frozen=True)
class FeatureSpec:
    name: str
    type: str                      # numeric | categorical | vector | image | text
    # numeric
    standardize: bool = False
    mean: float = 0.0
    std: float = 1.0
    impute: Optional[str] = None   # mean | median | None (a missing value makes the row invalid)
    fill: float = 0.0              # the imputed value (train split), before standardization
    missing_flag: bool = False
    # categorical / text
    vocab_size: int = 0            # learned values (ids FIRST_ID .. FIRST_ID + vocab_size - 1)
    vocabulary: Optional[str] = None  # the vocabulary file, relative to the shard set (one value per row)
    hash_buckets: Optional[int] = None
    min_count: int = 1
    embedding_dim: Optional[int] = None
    distinct_values: int = 0       # distinct train-split values seen when fitting (before min_count)
    # vector
    length: int = 0
    # image
    height: int = 0
    width: int = 0
    channels: int = 0
    source: str = "bytes"          # bytes | path
    storage: str = "decoded"       # decoded | encoded
    # text
    max_len: int = 0
    tokenize: bool = False         # a string column split into tokens (else an array column of tokens)
    # the source column's Spark type (simpleString), for the served model's input schema and score's checks
    source_type: str = ""

    @property
    def cardinality(self) -> int:
        """Distinct ids a categorical/text feature takes: an embedding table needs this many rows."""
        if self.hash_buckets:
            return self.hash_buckets + 1  # 0 is null
        return FIRST_ID + self.vocab_size

    @property
    def column(self) -> str:
        """The shard column that stores this feature (numeric features share the packed `features` column)."""
        return COLUMN_PREFIX + self.name

    @property
    def numeric_width(self) -> int:
        return (1 + int(self.missing_flag)) if self.type == "numeric" else 0

    @property
    def shape(self) -> tuple[int, ...]:
        """One row's shape in a batch (numeric features: their slots in batch['numeric'])."""
        return {"numeric": (self.numeric_width,), "categorical": (), "vector": (self.length,),
                "image": (self.channels, self.height, self.width), "text": (self.max_len,)}[self.type]

    @property
    def dtype(self) -> str:
        return {"numeric": "float32", "vector": "float32", "image": "uint8"}.get(self.type, "int64")

    @property
    def embedding_width(self) -> int:
        """The tabular model's embedding width: configured, else min(64, round(1.6 * cardinality^0.56))."""
        if self.embedding_dim:
            return self.embedding_dim
        return max(1, min(64, round(1.6 * self.cardinality ** 0.56)))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FeatureSpec":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class FeatureSet:
    """The fitted features of a shard set, in configuration order: what a model factory is called with."""

    features: tuple[FeatureSpec, ...] = field(default_factory=tuple)

    def __iter__(self) -> Iterator[FeatureSpec]:
        return iter(self.features)

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, name: str) -> FeatureSpec:
        for spec in self.features:
            if spec.name == name:
                return spec
        raise KeyError(f"no feature {name!r}; the features are {[f.name for f in self.features]}")

    def of_type(self, *types: str) -> list[FeatureSpec]:
        return [f for f in self.features if f.type in types]

    @property
    def numeric(self) -> list[FeatureSpec]:
        return self.of_type("numeric")

    @property
    def numeric_columns(self) -> list[str]:
        """Names of batch['numeric']'s columns: each numeric feature, then `<name>__missing` when flagged."""
        out = []
        for f in self.numeric:
            out.append(f.name)
            if f.missing_flag:
                out.append(f"{f.name}__missing")
        return out

    @property
    def numeric_width(self) -> int:
        return sum(f.numeric_width for f in self.numeric)

    @property
    def only_numeric(self) -> bool:
        return all(f.type == "numeric" for f in self.features)

    def batch_keys(self) -> list[str]:
        """Keys of a batch dict, in a fixed order."""
        keys = [NUMERIC_KEY] if self.numeric else []
        for f in self.features:
            if f.type != "numeric":
                keys.append(f.name)
                if f.type == "text":
                    keys.append(f.name + LENGTH_SUFFIX)
        return keys

    def to_list(self) -> list[dict[str, Any]]:
        return [f.to_dict() for f in self.features]

    @classmethod
    def from_list(cls, data) -> "FeatureSet":
        return cls(tuple(FeatureSpec.from_dict(d) for d in (data or ())))

    @classmethod
    def numeric_only(cls, names, means=None, stds=None, standardize: bool = False) -> "FeatureSet":
        """The classic shard set: numeric columns packed into one standardized vector."""
        means = list(means) if means is not None else [0.0] * len(names)
        stds = list(stds) if stds is not None else [1.0] * len(names)
        return cls(tuple(FeatureSpec(name=n, type="numeric", standardize=standardize, mean=float(m), std=float(s))
                         for n, m, s in zip(names, means, stds)))
