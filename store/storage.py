"""Where the platform's files live: a local directory or any fsspec URL, and how they are written.

Every file is written atomically (`atomic_write`): readers see the old file or the whole new one,
never half of one. Local files are private to the platform's user: files 0600, directories 0700.
`Storage` addresses input, shard and output files by key ("files/<id>.jsonl");
Parquet results use the same writer through `store.results`.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import IO

import fsspec


def url_to_fs(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The file system of a path or fsspec URL, and the path within it (no trailing slash)."""
    fs, path = fsspec.core.url_to_fs(str(url), **(storage_options or {}))
    return fs, path.rstrip("/") or "/"


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocols or "local" in protocols


@contextlib.contextmanager
def atomic_write(fs: fsspec.AbstractFileSystem, path: str) -> Iterator[IO[bytes]]:
    """A binary file that appears at `path` only when the block finishes without an error.

    It is written under a hidden temporary name next to `path` (``.<name>.<random>.tmp``). Local:
    fsynced, then renamed over `path` (atomic) and the rename made durable. Other fsspec stores:
    moved into place (a single PUT is atomic on object stores, so no partial object is ever visible
    under the final name).
    """
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
        return self.fs.open(self.path(key), "rb")

    def size(self, key: str) -> int:
        return int(self.fs.size(self.path(key)))

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(key), recursive=True)


_cache: dict[str, Storage] = {}


def get_storage(url: str) -> Storage:
    storage = _cache.get(url)
    if storage is None:
        storage = _cache[url] = Storage(url)
    return storage
