"""Offline generation with pagedbatch's engine on a tiny random-weight model.

    python examples/offline.py [MODEL_DIR]

Without MODEL_DIR a tiny Qwen3-shaped model is written to a temporary directory first
(its weights are random, so its text is gibberish: the point is the machinery).
"""

import sys
import tempfile
import time

from engine import LLM, SamplingParams
from engine.testing.tiny import write_tiny_model


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else str(write_tiny_model(tempfile.mkdtemp() + "/tiny", "qwen3"))
    llm = LLM(model=model)
    prompts = [
        "Hello, world!",
        {"prompt_token_ids": [5, 6, 7, 8]},
        "Paged attention stores the key value cache in fixed size blocks.",
    ] * 8
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    for out in outs[:3]:
        c = out.outputs[0]
        print(
            f"[{out.request_id}] {len(out.prompt_token_ids)} prompt tokens -> {len(c.token_ids)} tokens, "
            f"finish={c.finish_reason}: {c.text!r}"
        )
    chat = llm.chat([{"role": "user", "content": "Say hi"}], SamplingParams(temperature=0.8, seed=1, max_tokens=16))
    print("chat:", repr(chat[0].outputs[0].text))
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{len(outs)} requests, {tokens} output tokens in {elapsed:.2f}s ({tokens / elapsed:.0f} tok/s)")


if __name__ == "__main__":
    main()
