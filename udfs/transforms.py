"""Raw source columns -> model input arrays, from the fitted feature spec: ONE implementation for every
place a row becomes a tensor — the ETL's pack step, `shardline score`, the Spark ML transformer and the
served MLflow model (this file is shipped inside it, so it imports only numpy, pyarrow and, for images,
PIL; never `pipeline`).

Specs are the plain dicts of pipeline.config.feature_spec.FeatureSpec.to_dict(); vocabularies are Arrow
string arrays (id = FIRST_ID + position). Everything is vectorized over an Arrow batch, except image
decoding (PIL, one call per image) and hashing (one blake2b per distinct value of the batch).

Why not Spark ML's FeatureHasher/StringIndexer here: the served model must produce the same ids with no
Spark at all, and StringIndexer folds null and unseen values into one bucket; pyarrow's hash-table
lookup (`index_in`) does the vocabulary mapping at Arrow speed in both places.
"""
from __future__ import annotations

import hashlib
import io
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

NUMERIC_KEY = "numeric"
LENGTH_SUFFIX = "__len"
NULL_ID, OOV_ID, FIRST_ID = 0, 1, 2
# Token boundaries of a text feature: runs of anything but letters and digits (RE2 syntax, Unicode aware).
TOKEN_SPLIT = r"[^\pL\pN]+"


def _values(column) -> pa.Array:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def _floats(column) -> np.ndarray:
    """float64 values with nulls as NaN."""
    column = _values(column)
    if not pa.types.is_floating(column.type) and not pa.types.is_integer(column.type):
        column = pc.cast(column, pa.float64(), safe=False)
    return column.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)


def as_text(column) -> pa.Array:
    """A categorical column's values as text: integers in decimal, strings as they are (vocabularies and
    hashes are over this form, so the served model accepts either)."""
    column = _values(column)
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return column.cast(pa.string())
    if pa.types.is_floating(column.type):
        # 3.0 and 3 are one category: whole floats are written as integers.
        values = column.to_numpy(zero_copy_only=False)
        whole = np.isfinite(values) & (np.floor(values) == values)
        if whole[~np.isnan(values)].all():
            return pc.cast(pc.cast(column, pa.int64(), safe=False), pa.string())
    return pc.cast(column, pa.string())


# -- numeric ---------------------------------------------------------------------------------------
def numeric_block(columns: Mapping[str, Any], specs: Sequence[Mapping[str, Any]]):
    """(float32 [n, width], invalid [n, len(specs)]) for the numeric specs: standardized, imputed values
    filled (and their is-missing flag set), a missing value of a non-imputed feature flagged invalid."""
    specs = list(specs)
    rows = len(next(iter(columns.values()))) if columns else 0
    width = sum(1 + bool(s.get("missing_flag")) for s in specs)
    out = np.empty((rows, width), dtype=np.float32)
    invalid = np.zeros((rows, len(specs)), dtype=bool)
    j = 0
    for i, spec in enumerate(specs):
        values = _floats(columns[spec["name"]])
        missing = ~np.isfinite(values)
        if spec.get("impute"):
            if missing.any():
                values = np.where(missing, spec["fill"], values)
        else:
            invalid[:, i] = missing
        if spec.get("standardize"):
            values = (values - spec["mean"]) * (1.0 / spec["std"])
        out[:, j] = values
        j += 1
        if spec.get("missing_flag"):
            out[:, j] = missing
            j += 1
    return out, invalid


# -- categorical -----------------------------------------------------------------------------------
def stable_hash(text: str) -> int:
    """A 63-bit hash of a value's text that is the same in every process and Python version."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") >> 1


def hash_ids(text: pa.Array, buckets: int) -> np.ndarray:
    """int64 ids 1..buckets (0 for null), hashing each distinct value of the batch once."""
    encoded = pc.dictionary_encode(text)
    dictionary = encoded.dictionary.to_pylist()
    hashed = np.fromiter((stable_hash(v) % buckets + 1 for v in dictionary), dtype=np.int64, count=len(dictionary))
    indices = encoded.indices
    ids = np.full(len(text), NULL_ID, dtype=np.int64)
    valid = indices.is_valid().to_numpy(zero_copy_only=False)
    if len(dictionary):
        ids[valid] = hashed[indices.drop_null().to_numpy(zero_copy_only=False)]
    return ids


# Above this size a vocabulary is looked up through a pandas Index built once: pyarrow's index_in rebuilds
# its hash table from the value set on every call (4.7 us/row for 315k values against 0.18 us/row; below
# ~20k values index_in is the faster, bench/categorical_etl_bench.py).
LARGE_VOCABULARY = 20_000


class VocabularyIndex:
    """A vocabulary's value -> position lookup, built on first use and reused for every batch."""

    def __init__(self, vocabulary: pa.Array):
        self.vocabulary = vocabulary
        self._index = None

    def positions(self, values: pa.Array) -> np.ndarray:
        """Position of each distinct value of `values` in the vocabulary (-1: absent), per row; nulls -1."""
        import pandas as pd

        if self._index is None:
            self._index = pd.Index(self.vocabulary.to_numpy(zero_copy_only=False))
        encoded = pc.dictionary_encode(values)
        found = self._index.get_indexer(encoded.dictionary.to_numpy(zero_copy_only=False))
        indices = encoded.indices
        out = np.full(len(values), -1, dtype=np.int64)
        valid = indices.is_valid().to_numpy(zero_copy_only=False)
        if len(found):
            out[valid] = found[indices.drop_null().to_numpy(zero_copy_only=False)]
        return out


def vocab_ids(text: pa.Array, vocabulary) -> np.ndarray:
    """int64 ids: NULL_ID for null, OOV_ID for a value not in the vocabulary, FIRST_ID + its position.
    `vocabulary`: an Arrow string array, or a VocabularyIndex over one (large vocabularies)."""
    if isinstance(vocabulary, VocabularyIndex):
        positions = vocabulary.positions(text)
        ids = np.where(positions >= 0, positions + FIRST_ID, OOV_ID).astype(np.int64)
        if text.null_count:
            ids[text.is_null().to_numpy(zero_copy_only=False)] = NULL_ID
        return ids
    found = pc.index_in(text, value_set=vocabulary)
    ids = pc.fill_null(pc.add(found, FIRST_ID), OOV_ID).to_numpy(zero_copy_only=False).astype(np.int64)
    if text.null_count:
        ids[text.is_null().to_numpy(zero_copy_only=False)] = NULL_ID
    return ids


def categorical_ids(column, spec: Mapping[str, Any], vocabulary: Optional[pa.Array]) -> np.ndarray:
    text = as_text(column)
    if spec.get("hash_buckets"):
        return hash_ids(text, int(spec["hash_buckets"]))
    return vocab_ids(text, vocabulary)


# -- vector ----------------------------------------------------------------------------------------
def vector_matrix(column, length: int):
    """(float32 [n, length], invalid [n]): null, a wrong length or a non-finite entry is invalid."""
    column = _values(column)
    rows = len(column)
    out = np.zeros((rows, length), dtype=np.float32)
    if pa.types.is_fixed_size_list(column.type) and column.type.list_size == length and not column.null_count:
        flat = column.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
        out[:] = flat.reshape(rows, length)
        return out, ~np.isfinite(out).all(axis=1)
    if pa.types.is_fixed_size_list(column.type):
        column = column.cast(pa.list_(column.type.value_type))
    lengths = pc.fill_null(pc.list_value_length(column), -1).to_numpy(zero_copy_only=False)
    invalid = lengths != length
    good = ~invalid
    if good.any():
        kept = column.filter(pa.array(good))
        flat = pc.cast(kept.flatten(), pa.float64(), safe=False).to_numpy(zero_copy_only=False)
        out[good] = flat.reshape(-1, length).astype(np.float32)
        invalid |= ~np.isfinite(out).all(axis=1)
    return out, invalid


def vector_lengths(column) -> np.ndarray:
    """Each row's array length (-1 for null), for error messages."""
    column = _values(column)
    if pa.types.is_fixed_size_list(column.type):
        column = column.cast(pa.list_(column.type.value_type))
    return pc.fill_null(pc.list_value_length(column), -1).to_numpy(zero_copy_only=False)


# -- image -----------------------------------------------------------------------------------------
def decode_image(data: bytes, height: int, width: int, channels: int) -> np.ndarray:
    """uint8 [channels, height, width] from PNG/JPEG (any format PIL reads) bytes; raises on bad bytes."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        if image.format in ("JPEG",) and (image.width > 2 * width or image.height > 2 * height):
            image.draft("L" if channels == 1 else "RGB", (width, height))  # JPEG's cheap DCT downscale
        image = image.convert("L" if channels == 1 else "RGB")
        if image.size != (width, height):
            image = image.resize((width, height), Image.BILINEAR)
        pixels = np.asarray(image, dtype=np.uint8)
    return pixels[None] if channels == 1 else np.ascontiguousarray(pixels.transpose(2, 0, 1))


def image_bytes(column, source: str) -> list:
    """The encoded bytes of each row (None for null); source=path reads each file."""
    values = _values(column).to_pylist()
    if source != "path":
        return values
    out = []
    for path in values:
        if path is None:
            out.append(None)
            continue
        local = path[len("file://"):] if path.startswith("file://") else path
        try:
            with open(local, "rb") as fh:
                out.append(fh.read())
        except OSError:
            out.append(b"")
    return out


def decode_images(encoded: Sequence[Optional[bytes]], height: int, width: int, channels: int):
    """(uint8 [n, channels, height, width], invalid [n], first error text or None)."""
    out = np.zeros((len(encoded), channels, height, width), dtype=np.uint8)
    invalid = np.zeros(len(encoded), dtype=bool)
    first_error = None
    for i, data in enumerate(encoded):
        if data is None:
            invalid[i] = True
            continue
        try:
            out[i] = decode_image(data, height, width, channels)
        except Exception as exc:  # PIL raises several types for corrupt or truncated data
            invalid[i] = True
            first_error = first_error or f"{type(exc).__name__}: {exc}"
    return out, invalid, first_error


# -- text ------------------------------------------------------------------------------------------
def tokens_of(column, tokenize: bool) -> pa.Array:
    """A list<string> array of each row's tokens (null rows: null): split text, or an array column's items."""
    column = _values(column)
    if tokenize:
        pieces = pc.split_pattern_regex(pc.utf8_lower(column.cast(pa.string())), TOKEN_SPLIT)
    else:
        if pa.types.is_fixed_size_list(column.type) or pa.types.is_large_list(column.type):
            column = column.cast(pa.list_(column.type.value_type))
        pieces = pa.ListArray.from_arrays(column.offsets, as_text(column.values), mask=column.is_null()) \
            if column.offset == 0 else pa.array(column.to_pylist(), pa.list_(pa.string()))
    return pieces


def flat_tokens(tokens: pa.Array):
    """(token text array, row index of each token), empty tokens left out."""
    flat = tokens.flatten()
    parents = pc.list_parent_indices(tokens).to_numpy(zero_copy_only=False)
    keep = pc.fill_null(pc.not_equal(flat, ""), False)
    return flat.filter(keep), parents[keep.to_numpy(zero_copy_only=False)]


def text_ids(column, spec: Mapping[str, Any], vocabulary: pa.Array):
    """(int64 [n, max_len] ids, padded with 0; int64 [n] lengths, at most max_len)."""
    max_len = int(spec["max_len"])
    tokens = tokens_of(column, bool(spec.get("tokenize")))
    rows = len(tokens)
    ids = np.zeros((rows, max_len), dtype=np.int64)
    flat, parents = flat_tokens(tokens)
    if len(flat):
        values = vocab_ids(flat, vocabulary)
        counts = np.bincount(parents, minlength=rows)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        position = np.arange(len(parents)) - starts[parents]
        keep = position < max_len
        ids[parents[keep], position[keep]] = values[keep]
        lengths = np.minimum(counts, max_len).astype(np.int64)
    else:
        lengths = np.zeros(rows, dtype=np.int64)
    return ids, lengths


# -- a whole batch ---------------------------------------------------------------------------------
class Transform:
    """The fitted preprocessing of one shard set: raw Arrow columns in, the batch dict out.

    `apply(table)` returns (arrays keyed like a training batch, valid [n], invalid counts per column,
    first image error). Invalid rows' entries are zeros: callers drop them (ETL, score) or refuse them
    (the served model)."""

    def __init__(self, specs: Sequence[Mapping[str, Any]], vocabularies: Mapping[str, pa.Array]):
        self.specs = [dict(s) for s in specs]
        self.numeric = [s for s in self.specs if s["type"] == "numeric"]
        self.vocabularies = {name: VocabularyIndex(v) if len(v) > LARGE_VOCABULARY else v
                             for name, v in vocabularies.items()}

    @property
    def columns(self) -> list[str]:
        return [s["name"] for s in self.specs]

    def check(self, table):
        """(invalid [n], invalid counts per column, first image error): what `apply` would refuse, without
        building the outputs (vocabularies are not needed: a categorical or text value is never invalid)."""
        invalid = np.zeros(table.num_rows, dtype=bool)
        counts: dict[str, int] = {}
        image_error = None
        for spec in self.specs:
            name, kind = spec["name"], spec["type"]
            if kind == "numeric":
                if spec.get("impute"):
                    continue
                bad = ~np.isfinite(_floats(table.column(name)))
            elif kind == "vector":
                bad = vector_matrix(table.column(name), int(spec["length"]))[1]
            elif kind == "image":
                encoded = image_bytes(table.column(name), spec.get("source", "bytes"))
                _, bad, error = decode_images(encoded, int(spec["height"]), int(spec["width"]), int(spec["channels"]))
                image_error = image_error or error
            else:
                continue
            if bad.any():
                counts[name] = int(bad.sum())
                invalid |= bad
        return invalid, counts, image_error

    def apply(self, table):
        rows = table.num_rows
        arrays: dict[str, np.ndarray] = {}
        invalid = np.zeros(rows, dtype=bool)
        counts: dict[str, int] = {}
        image_error = None

        def flag(name: str, mask: np.ndarray) -> None:
            nonlocal invalid
            if mask.any():
                counts[name] = counts.get(name, 0) + int(mask.sum())
                invalid = invalid | mask

        if self.numeric:
            block, bad = numeric_block({s["name"]: table.column(s["name"]) for s in self.numeric}, self.numeric)
            arrays[NUMERIC_KEY] = block
            for i, spec in enumerate(self.numeric):
                flag(spec["name"], bad[:, i])
        for spec in self.specs:
            name, kind = spec["name"], spec["type"]
            if kind == "numeric":
                continue
            column = table.column(name)
            if kind == "categorical":
                arrays[name] = categorical_ids(column, spec, self.vocabularies.get(name))
            elif kind == "vector":
                arrays[name], bad = vector_matrix(column, int(spec["length"]))
                flag(name, bad)
            elif kind == "image":
                encoded = image_bytes(column, spec.get("source", "bytes"))
                arrays[name], bad, error = decode_images(encoded, int(spec["height"]), int(spec["width"]),
                                                         int(spec["channels"]))
                image_error = image_error or error
                flag(name, bad)
            elif kind == "text":
                arrays[name], arrays[name + LENGTH_SUFFIX] = text_ids(column, spec, self.vocabularies[name])
            else:
                raise ValueError(f"feature {name!r} has unknown type {kind!r}")
        return arrays, ~invalid, counts, image_error


def take_rows(arrays: Mapping[str, np.ndarray], keep: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v[keep] for k, v in arrays.items()}
