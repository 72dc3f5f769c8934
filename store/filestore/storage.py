"""Where the platform's files live: a local directory or any fsspec URL, and how they are written.

Every file is written atomically (`atomic_write`): readers see the old file or the whole new one,
never half of one. Local files are private to the platform's user: files 0600, directories 0700.
`Storage` addresses input, shard and output files by key ("files/<id>.jsonl");
Parquet results use the same writer through `store.results`.
"""

from __future__ import annotations

import contextlib
import io
import os
import uuid
from collections.abc import Iterator
from typing import IO

import fsspec
from fsspec.spec import AbstractBufferedFile

from store.filestore import storage_retries
from store.filestore.storage_faults import retrying

OBJECT_STORES = ("s3", "s3a")  # a file written there appears whole on close (a PUT or a completed multipart upload)


def url_to_fs(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The file system of a path or fsspec URL, and the path within it (no trailing slash).

    S3 (`s3://bucket/prefix`, s3fs): credentials and endpoint come from the usual AWS settings
    (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for MinIO/Ceph/moto, ...). Listings are
    not cached: parts and results are written by other processes and hosts. The S3 client's own retries
    are counted (`store.filestore.storage_retries`).
    """
    options = dict(storage_options or {})
    if str(url).split("://", 1)[0] in OBJECT_STORES:
        options.setdefault("use_listings_cache", False)
    fs, path = fsspec.core.url_to_fs(str(url), **options)
    if is_object_store(fs):
        storage_retries.observe(fs)
    return fs, path.rstrip("/") or "/"


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in _protocols(fs) or "local" in _protocols(fs)


def is_object_store(fs: fsspec.AbstractFileSystem) -> bool:
    return any(p in OBJECT_STORES for p in _protocols(fs))


@contextlib.contextmanager
def _object_write(fs: fsspec.AbstractFileSystem, path: str) -> Iterator[IO[bytes]]:
    """Written straight to `path`: the object exists only once `close` completes the upload (one PUT, or
    the multipart upload of a large file); on an error the upload is aborted and nothing appears."""
    f = fs.open(path, "wb")
    try:
        yield f
    except BaseException:
        with contextlib.suppress(Exception):
            f.discard()  # aborts the multipart upload (its uploaded parts are dropped)
        f.closed = True  # close() would complete the upload
        raise
    f.close()


@contextlib.contextmanager
def atomic_write(fs: fsspec.AbstractFileSystem, path: str) -> Iterator[IO[bytes]]:
    """A binary file that appears at `path` only when the block finishes without an error.

    It is written under a hidden temporary name next to `path` (``.<name>.<random>.tmp``). Local:
    fsynced, then renamed over `path` (atomic) and the rename made durable. S3: written to `path`
    itself, which appears only when the upload completes (`_object_write`). Other fsspec stores:
    moved into place.
    """
    if is_object_store(fs):
        with _object_write(fs, path) as f:
            yield f
        return
    parent, name = path.rsplit("/", 1) if "/" in path else (".", path)
    tmp = f"{parent}/.{name}.{uuid.uuid4().hex}.tmp"
    local = is_local(fs)
    if local:
        make_private_dirs(parent)
    else:
        fs.makedirs(parent, exist_ok=True)
    try:
        if local:
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE), "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(parent)
        else:
            with fs.open(tmp, "wb") as f:
                yield f
            fs.mv(tmp, path)
    except BaseException:
        with contextlib.suppress(Exception):
            if local:
                os.unlink(tmp)
            else:
                fs.rm(tmp)
        raise


PRIVATE_FILE, PRIVATE_DIR = 0o600, 0o700


def make_private_dirs(path: str) -> None:
    """`os.makedirs` with every directory it creates 0700 (its `mode` skips the intermediate ones)."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return
    make_private_dirs(os.path.dirname(path))
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, PRIVATE_DIR)


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):  # not every platform can open a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Storage:
    """Files by key under one root: uploads, shard inputs, output and error files."""

    def __init__(self, url: str):
        if not url:
            raise RuntimeError("no storage configured; set PAGEDBATCH_STORAGE_URL")
        self.url = url
        self.fs, root = url_to_fs(url)
        self.root = root.rstrip("/")
        if is_local(self.fs):
            make_private_dirs(self.root)

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def open_write(self, key: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        return atomic_write(self.fs, self.path(key))

    def open_read(self, key: str) -> IO[bytes]:
        """A standard binary reader (fsspec's remote files take no size in `readline`; line reading needs it).
        Opening is retried with backoff while the storage fails transiently (`store.filestore.storage_faults`)."""
        f = retrying(lambda: self.fs.open(self.path(key), "rb"), "opening a file")
        return io.BufferedReader(f) if isinstance(f, AbstractBufferedFile) else f

    def size(self, key: str) -> int:
        return int(retrying(lambda: self.fs.size(self.path(key)), "reading a file's size"))

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(key), recursive=True)


_cache: dict[str, Storage] = {}


def get_storage(url: str) -> Storage:
    storage = _cache.get(url)
    if storage is None:
        storage = _cache[url] = Storage(url)
    return storage
