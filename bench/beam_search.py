"""Beam search: beams as live sequences in the engine (`LLM.beam_search`) vs one request per beam and
step (vLLM's offline algorithm, which is how `LLM.beam_search` ran before), in one run.

    python -m bench.beam_search [--prompts 8] [--prompt-len 200] [--beam-width 4] [--max-tokens 32]
                                [--device cpu] [--threads 1] [--repeat 3]

Workload: bench.engine_cpu's Qwen3-shaped ~25M-parameter model with random float32 weights; prompts of
random tokens; EOS ignored. "computed tokens" counts the tokens the engine ran through the model (prefill
and decode); the peer recomputes each beam's last partial block every step, the engine computes each
prompt once and one token per beam per step after it.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

from bench.engine_cpu import BENCH_CONFIG


def request_per_step(llm, prompts, params):
    """The peer: every step sends each live beam's whole token list as a new one-token request; the
    prefix cache serves its full blocks."""
    from engine import SamplingParams
    from engine.beam.search import BeamSearchSequence, best_sequences, next_beams

    eos, step = llm.llm_engine.eos_token_id, SamplingParams(logprobs=2 * params.beam_width, max_tokens=1)
    live = [[BeamSearchSequence(list(p))] for p in prompts]
    finished = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        flat = [(i, b) for i, beams in enumerate(live) for b in beams]
        outs = llm.generate([{"prompt_token_ids": b.tokens} for _, b in flat], step, use_tqdm=False)
        for i in range(len(prompts)):
            mine = [(b, o.outputs[0].logprobs[0]) for (j, b), o in zip(flat, outs) if j == i]
            chosen, done = next_beams([b for b, _ in mine], [e for _, e in mine], eos, params)
            finished[i] += done
            live[i] = [b for _, b in chosen]
    tokenizer = llm.get_tokenizer()
    return [best_sequences(beams, done, eos, params, tokenizer) for beams, done in zip(live, finished)]


def timed(llm, run, prompts, params, repeat: int):
    """The best of `repeat` runs (each from a cold prefix cache): time, computed tokens, outputs."""
    from engine import BeamSearchParams

    run(llm, prompts[:2], BeamSearchParams(beam_width=params.beam_width, max_tokens=4, ignore_eos=True))  # warm-up
    best = None
    for _ in range(repeat):
        assert llm.reset_prefix_cache()
        before = llm.llm_engine.stats["tokens"]
        start = time.perf_counter()
        outs = run(llm, prompts, params)
        if llm.llm_engine.device.type == "cuda":
            torch.cuda.synchronize()
        result = (time.perf_counter() - start, llm.llm_engine.stats["tokens"] - before, outs)
        best = result if best is None or result[0] < best[0] else best
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a busy machine)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from engine import LLM, BeamSearchParams
    from engine.testing.tiny import write_tiny_model

    path = write_tiny_model(tempfile.mkdtemp() + "/bench-qwen3", "qwen3", **BENCH_CONFIG)
    rng = random.Random(0)
    prompts = [[rng.randrange(BENCH_CONFIG["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens, ignore_eos=True)
    print(
        f"model: Qwen3-shaped, float32, {args.device}, {torch.get_num_threads()} threads; {args.prompts} prompts "
        f"of {args.prompt_len} tokens, beam_width {args.beam_width}, {args.max_tokens} tokens"
    )

    def in_engine(llm, ps, p):
        return llm.beam_search([{"prompt_token_ids": x} for x in ps], p)

    rows = []
    for name, run in (
        ("beams in the engine (fork, copy-on-write)", in_engine),
        ("one request per beam and step (before)", request_per_step),
    ):
        llm = LLM(str(path), dtype="float32", device=args.device)
        rows.append((name, *timed(llm, run, prompts, params, args.repeat)))
        del llm

    def ids(out):
        return [s.tokens for s in out.sequences]

    same = sum(ids(a) == ids(b) for a, b in zip(rows[0][3], rows[1][3]))
    print(f"same beams (token ids) for {same}/{len(prompts)} prompts; time: the best of {args.repeat} runs")
    ours_s, ours_tokens = rows[0][1], rows[0][2]
    print()
    print(
        f"| {'beam search':<42} | {'time (s)':>8} | {'computed tokens':>15} | {'time / ours':>11} "
        f"| {'tokens / ours':>13} |"
    )
    print(f"|{'-' * 44}|{'-' * 10}|{'-' * 17}|{'-' * 13}|{'-' * 15}|")
    for name, seconds, tokens, _ in rows:
        print(
            f"| {name:<42} | {seconds:8.2f} | {tokens:15d} | {seconds / ours_s:10.2f}x "
            f"| {tokens / ours_tokens:12.2f}x |"
        )


if __name__ == "__main__":
    main()
