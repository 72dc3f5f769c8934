"""Checks of what a person typed, made before any work starts: each failure is one line, exit status 2."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from urllib.parse import urlparse

from pagedbatch.failures import usage_error


def json_object(text: str) -> dict:
    """An argparse type: the text is a JSON object (`--defaults`, `--metadata`; argparse names the flag)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def api_url(text: str) -> str:
    """An argparse type: an http(s) URL with a host."""
    parsed = urlparse(text)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not an API URL such as http://127.0.0.1:8000")
    return text.rstrip("/")


def readable_file(path: str) -> Path:
    """A file that exists and can be read."""
    file = Path(path)
    if not file.exists():
        raise usage_error(f"no such file: {path}")
    if file.is_dir():
        raise usage_error(f"{path} is a directory, not a file")
    if not os.access(file, os.R_OK):
        raise usage_error(f"cannot read {path}: permission denied")
    return file


def writable_output(path: str) -> str:
    """An output path (local, or an fsspec URL, not checked) whose directory exists and can be written."""
    if "://" in path:
        return path
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise usage_error(f"cannot write {path}: it is a directory")
    if not folder.is_dir():
        raise usage_error(f"cannot write {path}: no such directory {folder}")
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise usage_error(f"cannot write {path}: permission denied")
    return path


def model_directory(path: str, flag: str = "--model") -> Path:
    """A local model directory: exists, is a directory and has a config.json."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise usage_error(f"{flag}: no such model directory: {path} ('pagedbatch tiny-model DIR' writes a test one)")
    if not folder.is_dir():
        raise usage_error(f"{flag}: {path} is a file; give a model directory (config.json and weights)")
    if not (folder / "config.json").is_file():
        raise usage_error(f"{flag}: {path} has no config.json; is it a Hugging Face model directory?")
    return folder
