"""Stored inputs, shard inputs and results are private to the platform's user: files 0600, dirs 0700."""

import os
import stat
from pathlib import Path

from store.filestore.storage import Storage
from tests.helpers import MODEL, chat_line, jsonl, validated


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_storage_writes_private_files_and_directories(tmp_path):
    old = os.umask(0o022)  # the usual umask, which alone would give 0644 files and 0755 dirs
    try:
        storage = Storage(str(tmp_path / "root"))
        with storage.open_write("a/b/c.jsonl") as f:
            f.write(b"x\n")
    finally:
        os.umask(old)
    for d in (tmp_path / "root", tmp_path / "root" / "a", tmp_path / "root" / "a" / "b"):
        assert _mode(d) == 0o700, d
    assert _mode(tmp_path / "root" / "a" / "b" / "c.jsonl") == 0o600


def test_uploads_shard_inputs_and_results_are_private(platform):
    client = platform.app().test_client()
    body = jsonl([chat_line("a", "hi"), "not json"])
    job = validated(client, client.post(f"/v1/jobs?model={MODEL}", data=body, content_type="application/x-ndjson"))
    root = Path(platform.settings.storage_url)
    written = [
        root / "files" / f"{job['input_file_id']}.jsonl",
        *sorted((root / "jobs" / job["id"]).rglob("*")),
        *sorted((root / "results" / job["id"]).rglob("*")),
    ]
    assert any(p.suffix == ".parquet" for p in written) and any("shard-" in p.name for p in written)
    for path in written:
        assert _mode(path) == (0o700 if path.is_dir() else 0o600), path
