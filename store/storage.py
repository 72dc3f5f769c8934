"""Blob storage for input, shard and output files: a local directory or any fsspec URL.

Keys are relative paths ("jobs/<id>/input.jsonl"). Writes are atomic: a temporary object is
written and then moved into place, so readers never see a half-written file.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import IO

import fsspec


class Storage:
    def __init__(self, url: str):
        if not url:
            raise RuntimeError("no storage configured; set PAGEDBATCH_STORAGE_URL")
        self.url = url
        self.fs, root = fsspec.core.url_to_fs(url)
        self.root = root.rstrip("/")
        self.local = "file" in (
            self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        )
        if self.local:
            os.makedirs(self.root, exist_ok=True)

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def url_for(self, key: str) -> str:
        """The key as a URL that fsspec (and pyarrow) can open from any process."""
        return self.path(key) if self.local else self.fs.unstrip_protocol(self.path(key))

    @contextlib.contextmanager
    def open_write(self, key: str, mode: str = "wb") -> Iterator[IO]:
        final = self.path(key)
        tmp = f"{final}.tmp-{uuid.uuid4().hex}"
        self.fs.makedirs(final.rsplit("/", 1)[0], exist_ok=True)
        try:
            with self.fs.open(tmp, mode) as f:
                yield f
            self.fs.mv(tmp, final)
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm(tmp)
            raise

    def open_read(self, key: str, mode: str = "rb") -> IO:
        return self.fs.open(self.path(key), mode)

    def exists(self, key: str) -> bool:
        return self.fs.exists(self.path(key))

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
