"""Test helper, the bytes of a Delta deletion vector (DV), for :mod:`delta_dv`, which commits them.

Following the Delta protocol (delta-io/delta ``PROTOCOL.md``):

* "Deletion Vector Format": the bitmap is a ``RoaringBitmapArray``: the magic
  number 1681511377 (little endian) followed by the 64-bit roaring "portable"
  serialization (u64 LE bucket count, then per bucket a u32 LE high key and a
  portable 32-bit roaring bitmap).
* "Deletion Vector File Storage Format" (storage type ``"u"``): a
  ``deletion_vector_<uuid>.bin`` file in the table root: a version byte ``1``,
  then a big-endian u32 size, the bitmap bytes and a big-endian CRC-32 of them.
  The descriptor has ``offset=1``, ``sizeInBytes`` = bitmap size and the Z85
  encoded UUID as ``pathOrInlineDv``.
* Storage type ``"i"`` (inline): the bitmap bytes, zero-padded to a multiple of
  4, Z85 encoded into ``pathOrInlineDv``; ``sizeInBytes`` is the unpadded size.

Its checks (no table needed) run with :mod:`delta_dv`'s self-check, or alone::

    .venv/bin/python tests/pipeline/tables/delta_dv_format.py
"""

from __future__ import annotations

import struct
import uuid
import zlib
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import unquote

import pyroaring

__all__ = [
    "DV_MAGIC",
    "read_deletion_vector",
    "write_deletion_vector",
    "serialize_roaring_bitmap_array",
    "deserialize_roaring_bitmap_array",
    "dv_relative_path",
    "z85_encode",
    "z85_decode",
]

DV_MAGIC = 1681511377  # RoaringBitmapArray, portable serialization
DV_FILE_FORMAT_VERSION = 1

# ---------------------------------------------------------------------------
# Z85 (ZeroMQ RFC 32).  NB: base64.b85encode uses a different alphabet.
# ---------------------------------------------------------------------------

_Z85_ALPHABET = (
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)
_Z85_INDEX = {c: i for i, c in enumerate(_Z85_ALPHABET)}


def z85_encode(data: bytes) -> str:
    """Z85-encode ``data``; its length must be a multiple of 4."""
    if len(data) % 4:
        raise ValueError(f"Z85 input length must be a multiple of 4, got {len(data)}")
    out = []
    for (word,) in struct.iter_unpack(">I", data):
        chunk = []
        for _ in range(5):
            word, rem = divmod(word, 85)
            chunk.append(_Z85_ALPHABET[rem])
        out.extend(reversed(chunk))
    return "".join(out)


def z85_decode(text: str) -> bytes:
    """Decode Z85 ``text``; its length must be a multiple of 5."""
    if len(text) % 5:
        raise ValueError(f"Z85 input length must be a multiple of 5, got {len(text)}")
    out = bytearray()
    for i in range(0, len(text), 5):
        word = 0
        for c in text[i : i + 5]:
            word = word * 85 + _Z85_INDEX[c]
        if word > 0xFFFFFFFF:
            raise ValueError(f"invalid Z85 group {text[i:i + 5]!r}")
        out += struct.pack(">I", word)
    return bytes(out)


# ---------------------------------------------------------------------------
# RoaringBitmapArray (PROTOCOL.md "Deletion Vector Format")
# ---------------------------------------------------------------------------


def serialize_roaring_bitmap_array(rows: Iterable[int]) -> bytes:
    """Magic number + 64-bit roaring portable serialization of ``rows``."""
    buckets: dict[int, list[int]] = {}
    for row in rows:
        row = int(row)
        if row < 0 or row >= 1 << 63:  # high keys must have a 0 top bit
            raise ValueError(f"row index out of range: {row}")
        buckets.setdefault(row >> 32, []).append(row & 0xFFFFFFFF)
    out = bytearray(struct.pack("<I", DV_MAGIC))
    out += struct.pack("<Q", len(buckets))
    for key in sorted(buckets):
        out += struct.pack("<I", key)
        # optimize=False: plain array/bitmap containers, no run containers.
        out += pyroaring.BitMap(buckets[key], optimize=False).serialize()
    return bytes(out)


def deserialize_roaring_bitmap_array(data: bytes) -> list[int]:
    """Inverse of :func:`serialize_roaring_bitmap_array` (trailing bytes ignored)."""
    (magic,) = struct.unpack_from("<I", data, 0)
    if magic != DV_MAGIC:
        raise ValueError(f"unsupported deletion vector magic number {magic}")
    (n_buckets,) = struct.unpack_from("<Q", data, 4)
    pos = 12
    rows: list[int] = []
    for _ in range(n_buckets):
        (key,) = struct.unpack_from("<I", data, pos)
        pos += 4
        bitmap = pyroaring.BitMap.deserialize(data[pos:])
        pos += len(bitmap.serialize())
        rows.extend((key << 32) | low for low in bitmap)
    return rows


# ---------------------------------------------------------------------------
# Deletion vector descriptors
# ---------------------------------------------------------------------------


def dv_relative_path(path_or_inline_dv: str) -> str:
    prefix, encoded = path_or_inline_dv[:-20], path_or_inline_dv[-20:]
    dv_uuid = uuid.UUID(bytes=z85_decode(encoded))
    name = f"deletion_vector_{dv_uuid}.bin"
    return f"{prefix}/{name}" if prefix else name


def read_deletion_vector(table_path: str, descriptor: dict[str, Any]) -> list[int]:
    """Deleted row indexes described by a ``deletionVector`` descriptor."""
    storage = descriptor["storageType"]
    size = int(descriptor["sizeInBytes"])
    if storage == "i":
        data = z85_decode(descriptor["pathOrInlineDv"])[:size]
    else:
        if storage == "u":
            file = Path(table_path) / dv_relative_path(descriptor["pathOrInlineDv"])
        elif storage == "p":
            file = Path(unquote(descriptor["pathOrInlineDv"].removeprefix("file://")))
        else:
            raise ValueError(f"unknown deletion vector storage type {storage!r}")
        raw = file.read_bytes()
        if raw[0] != DV_FILE_FORMAT_VERSION:
            raise ValueError(f"unsupported deletion vector file version {raw[0]}")
        offset = int(descriptor.get("offset") or 1)
        (stored_size,) = struct.unpack_from(">I", raw, offset)
        if stored_size != size:
            raise ValueError(f"DV size mismatch: log says {size}, file says {stored_size}")
        data = raw[offset + 4 : offset + 4 + size]
        (crc,) = struct.unpack_from(">I", raw, offset + 4 + size)
        if crc != zlib.crc32(data):
            raise ValueError("deletion vector CRC-32 mismatch")
    rows = deserialize_roaring_bitmap_array(data)
    if len(rows) != int(descriptor["cardinality"]):
        raise ValueError("deletion vector cardinality mismatch")
    return rows


def write_deletion_vector(table_path: Path, bitmap: bytes, storage_type: str) -> dict[str, Any]:
    """Store ``bitmap`` (a serialized RoaringBitmapArray) as storage type ``"u"`` (a framed
    ``deletion_vector_<uuid>.bin`` file in ``table_path``) or ``"i"`` (inline); returns the descriptor
    without its ``cardinality``."""
    if storage_type == "i":
        padded = bitmap + b"\0" * (-len(bitmap) % 4)
        return {"storageType": "i", "pathOrInlineDv": z85_encode(padded), "sizeInBytes": len(bitmap)}
    if storage_type != "u":
        raise ValueError(f"storage_type must be 'u' or 'i', got {storage_type!r}")
    dv_uuid = uuid.uuid4()
    payload = (
        bytes([DV_FILE_FORMAT_VERSION])
        + struct.pack(">I", len(bitmap))
        + bitmap
        + struct.pack(">I", zlib.crc32(bitmap))
    )
    with open(table_path / f"deletion_vector_{dv_uuid}.bin", "xb") as fh:
        fh.write(payload)
    return {
        "storageType": "u",
        "pathOrInlineDv": z85_encode(dv_uuid.bytes),
        "offset": 1,
        "sizeInBytes": len(bitmap),
    }


# ---------------------------------------------------------------------------
# Self-check
# ---------------------------------------------------------------------------


def self_check() -> None:  # pragma: no cover - run by hand
    """The serialization against PROTOCOL.md's example and pyroaring; the descriptor's file name."""
    # PROTOCOL.md's inline example (rows 3,4,7,11,18,29) is in the older *native*
    # layout (big-endian magic 1681511376, u32 bucket count, u32 size per bucket),
    # which delta-kernel rejects; its 32-bit roaring bucket must still equal ours.
    example = z85_decode("wi5b=000010000siXQKl0rr91000f55c8Xg0@@D72lkbi5=-{L")
    assert struct.unpack_from(">I", example)[0] == DV_MAGIC - 1
    ours = serialize_roaring_bitmap_array([3, 4, 7, 11, 18, 29])
    assert ours[:4] == struct.pack("<I", DV_MAGIC) and ours[4:16] == struct.pack("<QI", 1, 0)
    assert ours[16:] == example[12:] == pyroaring.BitMap([3, 4, 7, 11, 18, 29]).serialize()
    assert deserialize_roaring_bitmap_array(ours) == [3, 4, 7, 11, 18, 29]
    assert dv_relative_path("ab^-aqEH.-t@S}K{vb[*k^") == (
        "ab/deletion_vector_d2c639aa-8816-431a-aaf6-d3fe2512ff61.bin"
    )
    assert deserialize_roaring_bitmap_array(serialize_roaring_bitmap_array([1, 5, (3 << 32) + 2])) == [
        1,
        5,
        (3 << 32) + 2,
    ]
    print("format self-check OK")


if __name__ == "__main__":
    self_check()
