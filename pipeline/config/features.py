"""Typed entries of ``data.features``: what each source column is and how the ETL turns it into a tensor.

``data.features`` is a list whose items are either a column name (a numeric feature with the defaults,
as before) or one of the entries below, chosen by ``type``. The ETL fits each on the train split
(statistics, vocabularies) and records the fitted result in the manifest
(:class:`pipeline.config.feature_spec.FeatureSpec`).
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Batch keys the loader uses itself: a feature may not take them.
RESERVED_NAMES = ("numeric", "label")
FEATURE_TYPES = ("numeric", "categorical", "vector", "image", "text")


class _Feature(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    # The source column; also the feature's key in a batch and its input name in the served model.
    name: str = Field(min_length=1)

    @model_validator(mode="after")
    def _not_reserved(self):
        if self.name in RESERVED_NAMES or "__" in self.name:
            raise ValueError(f"feature name {self.name!r} is reserved or contains '__' (the loader's batch keys "
                             f"{list(RESERVED_NAMES)} and '<name>__len'); rename the column")
        return self


class NumericFeature(_Feature):
    """A scalar number. All numeric features travel together as ``batch['numeric']`` float32 [B, n]."""

    type: Literal["numeric"] = "numeric"  # the feature kind of this entry
    # null: data.standardize decides. Statistics come from the train split only.
    standardize: Optional[bool] = None
    # null: a null/NaN/inf value makes the row invalid (data.invalid_rows). mean/median: replaced by the
    # train split's mean/median of the valid values, and an is-missing flag column is added after it.
    impute: Optional[Literal["mean", "median"]] = None
    missing_flag: bool = True  # with impute: also give the model a 0/1 is-missing input


class CategoricalFeature(_Feature):
    """A string or integer column as an int64 id: 0 is null, 1 out-of-vocabulary, 2.. the vocabulary
    (most frequent first), or with ``hash_buckets`` 0 null and 1..hash_buckets a hash of the value."""

    type: Literal["categorical"] = "categorical"  # the feature kind of this entry
    min_count: int = Field(1, ge=1)          # train-split occurrences a value needs to get its own id
    max_vocab: int = Field(100_000, ge=1)    # more qualifying values than this is an error: use hash_buckets
    # hash values into this many ids instead of learning a vocabulary (unbounded cardinality)
    hash_buckets: Optional[int] = Field(None, ge=1, le=2**31 - 2)
    # The tabular model's embedding width; null: min(64, round(1.6 * cardinality ** 0.56)) (fast.ai's rule).
    embedding_dim: Optional[int] = Field(None, ge=1, le=4096)


class VectorFeature(_Feature):
    """A fixed-length numeric array (array<float|double|int...>) or Spark ML Vector column: float32 [B, length]."""

    type: Literal["vector"] = "vector"  # the feature kind of this entry
    length: int = Field(ge=1, le=1_000_000)  # the fixed array length; a row of another length is invalid


class ImageFeature(_Feature):
    """Encoded PNG/JPEG bytes (source: bytes) or a column of file paths (source: path), decoded with PIL,
    converted to ``channels`` and resized to height x width: uint8 [B, channels, height, width]."""

    type: Literal["image"] = "image"  # the feature kind of this entry
    height: int = Field(ge=1, le=8192)  # decoded images are resized to height x width
    width: int = Field(ge=1, le=8192)  # decoded images are resized to height x width
    channels: Literal[1, 3] = 3  # 1: grayscale, 3: RGB (converted on decode)
    # bytes: the column holds encoded PNG/JPEG bytes; path: it holds file paths to read
    source: Literal["bytes", "path"] = "bytes"
    # decoded: uint8 pixels in the shards (bigger files, no decode while training); encoded: the image bytes,
    # decoded by the loader's reader threads (small files, decode cost per epoch). See bench/image_bench.py.
    storage: Literal["decoded", "encoded"] = "decoded"


class TextFeature(_Feature):
    """Token ids, int64 [B, max_len] (0 pad, 1 out-of-vocabulary, 2.. vocabulary) plus ``<name>__len``.

    A string column is lower-cased and split on runs of characters that are not letters or digits; an
    array<int> column is a sequence of tokens already. Either way the vocabulary is learned on the train
    split, so ids are dense and 0/1 keep their meaning."""

    type: Literal["text"] = "text"  # the feature kind of this entry
    # token ids per row: longer rows are truncated, shorter padded (lengths kept)
    max_len: int = Field(ge=1, le=100_000)
    min_count: int = Field(1, ge=1)  # train-split occurrences a token needs to get its own id
    max_vocab: int = Field(50_000, ge=1)  # the vocabulary's size cap (most frequent tokens kept)
    # the tabular model's embedding width for this text; null: chosen from the vocabulary size
    embedding_dim: Optional[int] = Field(None, ge=1, le=4096)


FeatureEntry = Annotated[Union[NumericFeature, CategoricalFeature, VectorFeature, ImageFeature, TextFeature],
                         Field(discriminator="type")]


def as_entries(features: list) -> list:
    """``data.features`` items as typed entries: a bare column name is a numeric feature."""
    return [NumericFeature(name=f) if isinstance(f, str) else f for f in features]


def is_plain(features: Optional[list]) -> bool:
    """True for the classic form: null, or numeric features only without imputation (the packed path)."""
    if features is None:
        return True
    return all(isinstance(f, str) or (isinstance(f, NumericFeature) and f.impute is None and f.standardize is None)
               for f in features)
