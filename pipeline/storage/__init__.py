"""Where files live: a local path or any URL pyarrow or fsspec serve (s3://, gs://, abfss://, hdfs://, ...).

`resolve(url)` gives (pyarrow FileSystem, path inside it); everything else here is built on that, so
the shard writer, the loader, manifests, evaluation and scoring open files the same way whatever the
store. Credentials come only from the environment/config chain the store's own SDK reads
(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_SESSION_TOKEN, AWS_PROFILE, instance roles; GOOGLE_*; AZURE_*):
never from shardline's config, never passed explicitly, so a pickled filesystem (shipped to executors)
carries none and nothing here can log one. For S3 the endpoint and region are read from
AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL and AWS_REGION / AWS_DEFAULT_REGION explicitly, since pyarrow
before 15 ignores the endpoint variables (MinIO, moto, Ceph, R2 need them).

Object stores have no rename: callers that commit by rename locally publish a small pointer object last
instead (see pipeline/shards/publish.py); a single object PUT is atomic, so a reader sees the old
object or the new one, never a part.
"""
from __future__ import annotations

import logging
import os
import posixpath
from typing import Optional
from urllib.parse import urlparse

log = logging.getLogger(__name__)

_LOCAL_SCHEMES = ("", "file")
_cache: dict = {}


def scheme(url: str | os.PathLike) -> str:
    text = str(url)
    return urlparse(text).scheme.lower() if "://" in text else ""


def is_remote(url: str | os.PathLike) -> bool:
    """True for a URL of a store other than the local filesystem (s3://, gs://, ..., not file://)."""
    return scheme(url) not in _LOCAL_SCHEMES


def spark_native(url: str | os.PathLike) -> bool:
    """Whether Spark's own Parquet reader/writer reaches `url` without extra jars: local paths and the
    Hadoop filesystems every Spark distribution (or Databricks) ships. Object-store URLs (s3://, gs://,
    abfss://) go through pyarrow in the Python workers instead (pipeline/storage/spark_io.py)."""
    return scheme(url) in _LOCAL_SCHEMES + ("hdfs", "viewfs", "dbfs")


S3_ATTEMPTS = 10
S3_CONNECT_S = 3.0


def _s3_options() -> dict:
    options: dict = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        parsed = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
        options["endpoint_override"] = parsed.netloc + parsed.path.rstrip("/")
        options["scheme"] = parsed.scheme or "https"
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options["region"] = region
    return options


def _filesystem(kind: str, netloc: str):
    """One filesystem per (scheme, endpoint settings) and process: S3 clients are costly to build."""
    options = _s3_options() if kind in ("s3", "s3a") else {}
    key = (kind, netloc, tuple(sorted(options.items())))
    fs = _cache.get(key)
    if fs is None:
        fs = _cache[key] = _build(kind, netloc, options)
    return fs


def _build(kind: str, netloc: str, options: dict):
    import pyarrow.fs as pafs

    if kind in ("s3", "s3a"):
        # pyarrow's default (3 attempts, ~2.7 s against an unreachable endpoint) turns a host's network blip
        # into a failed read, and the rank's failure into a retried attempt: measured on the multi-host
        # testbed, a 12 s link cut failed rank 1's shard read while the PS would have waited 60 s. These
        # retries ride out about a minute of an unreachable store (backoff plus S3_CONNECT_S a try).
        return pafs.S3FileSystem(**options, connect_timeout=S3_CONNECT_S,
                                 retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=S3_ATTEMPTS))
    try:
        fs, _ = pafs.FileSystem.from_uri(f"{kind}://{netloc}/")
        return fs
    except (ValueError, OSError, NotImplementedError):
        pass  # a scheme pyarrow has no native filesystem for: fsspec's (gcsfs, adlfs, dbfs, ...)
    import fsspec

    try:
        return pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem(kind)))
    except (ValueError, ImportError) as exc:
        from pipeline.errors import ConfigError

        raise ConfigError(f"no filesystem serves {kind}:// URLs ({exc}); use a local path or a URL of a store "
                          "pyarrow or an installed fsspec package serves (s3://, gs://, abfss:// with adlfs, "
                          "hdfs://)") from None


def resolve(url: str | os.PathLike):
    """(pyarrow FileSystem, path in it) of a local path or a store URL; local paths are made absolute."""
    import pyarrow.fs as pafs

    text = str(url)
    kind = scheme(text)
    if kind in _LOCAL_SCHEMES:
        path = text[len("file://"):] if text.startswith("file://") else text
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))
    parsed = urlparse(text)
    path = (parsed.netloc + parsed.path).rstrip("/")
    return _filesystem(kind, parsed.netloc), path


def join(base: str | os.PathLike, *parts: str) -> str:
    """`base`/`parts`: URLs join with '/', local paths with os.path.join."""
    if is_remote(base):
        return posixpath.join(str(base).rstrip("/"), *parts)
    return os.path.join(str(base), *parts)


def url_of(base: str, fs_path: str) -> str:
    """The URL of `fs_path` (a path inside `base`'s filesystem, as listings return it)."""
    if not is_remote(base):
        return fs_path
    return f"{scheme(base)}://{fs_path.lstrip('/')}"


def exists(url: str | os.PathLike) -> bool:
    import pyarrow.fs as pafs

    fs, path = resolve(url)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def read_bytes(url: str | os.PathLike) -> bytes:
    fs, path = resolve(url)
    with fs.open_input_stream(path) as f:
        return f.read()


def write_bytes(url: str | os.PathLike, data: bytes) -> None:
    """Write `data` as one object (atomic on object stores: it appears whole on close). Local callers
    wanting atomicity write a temporary name and os.replace it themselves."""
    fs, path = resolve(url)
    ensure_dir(fs, posixpath.dirname(path) if is_remote(url) else os.path.dirname(path))
    with fs.open_output_stream(path) as f:
        f.write(data)


def write_atomic(url: str | os.PathLike, data: bytes) -> None:
    """Readers see the old file or all of `data`: one PUT on an object store, a temporary + rename locally."""
    if is_remote(url):
        write_bytes(url, data)
        return
    path = os.fspath(url)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def ensure_dir(fs, path: str) -> None:
    """Create `path` on a local filesystem; object stores have no folders to create."""
    import pyarrow.fs as pafs

    if isinstance(fs, pafs.LocalFileSystem):
        fs.create_dir(path, recursive=True)


def list_files(url: str | os.PathLike, recursive: bool = True) -> dict[str, int]:
    """fs path -> size of every file below `url` (one listing, not a request per file); {} if absent."""
    import pyarrow.fs as pafs

    fs, path = resolve(url)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return {}
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=recursive, allow_not_found=True))
    return {info.path: info.size for info in infos if info.type == pafs.FileType.File}


def list_dirs(url: str | os.PathLike) -> list[str]:
    """Names of the folders (common prefixes) directly below `url`."""
    import pyarrow.fs as pafs

    fs, path = resolve(url)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=False, allow_not_found=True))
    return sorted(posixpath.basename(i.path.rstrip("/")) for i in infos if i.type == pafs.FileType.Directory)


def delete_dir(url: str | os.PathLike) -> None:
    """Remove `url` and everything below it; absent is fine."""
    import pyarrow.fs as pafs

    fs, path = resolve(url)
    if fs.get_file_info(path).type != pafs.FileType.NotFound:
        fs.delete_dir(path)


def open_parquet(url: str, pre_buffer: Optional[bool] = None):
    """A ParquetFile on any store. Remote files are read by ranged requests (only the footer and the
    column chunks a read asks for); pre_buffer coalesces a row group's chunks into few large requests,
    which is what matters for latency on object stores, so it is on there by default."""
    import pyarrow.parquet as pq

    if not is_remote(url):
        return pq.ParquetFile(url, pre_buffer=bool(pre_buffer))
    fs, path = resolve(url)
    return pq.ParquetFile(fs.open_input_file(path), pre_buffer=True if pre_buffer is None else pre_buffer)
