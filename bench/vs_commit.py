"""Our engine against itself at another commit, side by side in one run: did a change slow it down?

    python -m bench.vs_commit --base <commit> [--head <commit>] [--workloads mixed] [--dtypes float32] [--rounds 3]

The base commit's tree (and --head's, else the working tree is measured) is extracted with `git
archive` into a temporary directory (no worktree is touched). Both engines run `bench.vs_vllm`'s
workloads and model (greedy, EOS ignored, prefix caching on), each in a fresh process whose
PYTHONPATH is its own tree, alternating, the best time of `--rounds` counting. Prints output
tokens/s of each, their ratio, and whether the token ids agree (they must, for a change that keeps
behaviour)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

from bench.vs_vllm import ARCH_CONFIGS, write_models

REPO = Path(__file__).resolve().parent.parent
# the child loads vs_vllm by file path from this tree; `engine` resolves through PYTHONPATH
CHILD = (
    "import sys, json, importlib.util as u; s = u.spec_from_file_location('vs_vllm', sys.argv[1]); "
    "m = u.module_from_spec(s); s.loader.exec_module(m); "
    "json.dump(m.run_child('ours', *sys.argv[2:5]), open(sys.argv[5], 'w'))"
)


def extract(commit: str) -> Path:
    archive = subprocess.run(["git", "archive", commit], cwd=REPO, capture_output=True, check=True).stdout
    target = Path(tempfile.mkdtemp(prefix=f"vs-commit-{commit[:10]}-"))
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")
    return target


def spawn(tree: Path, model: str, dtype: str, name: str) -> dict:
    out = tempfile.mktemp(suffix=".json")
    env = dict(os.environ, PYTHONPATH=str(tree))
    argv = [sys.executable, "-c", CHILD, str(REPO / "bench" / "vs_vllm.py"), model, dtype, name, out]
    proc = subprocess.run(argv, env=env, cwd=tree, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree} {dtype} {name} failed:\n{proc.stderr[-4000:]}")
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True, help="the commit to compare with")
    parser.add_argument("--head", default=None, help="a commit to measure instead of the working tree")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--workloads", default="mixed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arch", choices=sorted(ARCH_CONFIGS), default="llama")
    args = parser.parse_args()
    models = write_models(args.arch, args.workloads.split(","))
    trees = {"head": extract(args.head) if args.head else REPO, "base": extract(args.base)}
    rows = []
    for dtype in args.dtypes.split(","):
        for name in args.workloads.split(","):
            best: dict[str, dict] = {}
            for r in range(args.rounds):
                for which in ("head", "base") if r % 2 == 0 else ("base", "head"):
                    result = spawn(trees[which], models[name], dtype, name)
                    if which not in best or result["elapsed"] < best[which]["elapsed"]:
                        best[which] = result
            head, base = best["head"], best["base"]
            tps = {k: v["tokens"] / v["elapsed"] for k, v in best.items()}
            same = head["token_ids"] == base["token_ids"]
            rows.append((dtype, name, tps["head"], tps["base"], tps["head"] / tps["base"], same))
            print(f"  {dtype} {name}: head {tps['head']:,.0f} tok/s, base {tps['base']:,.0f} tok/s", flush=True)
    print(f"\n| dtype | workload | head tok/s | {args.base[:10]} tok/s | head / base | same tokens |")
    print("|---|---|---:|---:|---:|---|")
    for dtype, name, head, base, ratio, same in rows:
        print(f"| {dtype} | {name} | {head:,.0f} | {base:,.0f} | {ratio:.2f}x | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
