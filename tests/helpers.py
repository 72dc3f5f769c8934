"""Helpers shared by the test modules: the engine's reference checks, batch-file lines, and
processes and ports. Fixtures live in conftest.py and the *_fixtures.py plugins it registers."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny"  # the name the platform harnesses serve their tiny model under

# ---- the engine ---------------------------------------------------------------------------------


def assert_pool_free(engine) -> None:
    """No leaked block and nothing left running."""
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks() == engine.block_manager.num_blocks


def make_prompts(seed: int, count: int = 16, vocab: int = 512, shared_prefixes: bool = False):
    """Token-id prompts of lengths around block boundaries, and a max_tokens for each."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(n)] for n in (40, 100, 200)]
    lengths = [1, 15, 16, 17, 300, 33] + [rng.randint(1, 300) for _ in range(count - 6)]
    prompts = []
    for i, n in enumerate(lengths):
        if shared_prefixes:
            prefix = prefixes[i % 3]
            prompts.append(prefix + [rng.randrange(vocab) for _ in range(rng.randint(0, 60))])
        else:
            prompts.append([rng.randrange(vocab) for _ in range(n)])
    max_tokens = [rng.randint(1, 40) for _ in prompts]
    return prompts, max_tokens


_reference_cache: dict = {}


def reference(path, prompts, max_tokens, **load):
    """transformers greedy continuations, one prompt at a time (no padding), memoised; `load`: more
    from_pretrained arguments (e.g. a quantization_config)."""
    key = (str(path), tuple(map(tuple, prompts)), tuple(max_tokens), repr(sorted(load.items())))
    if key not in _reference_cache:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load).eval()
        _reference_cache[key] = hf_greedy(model, prompts, max_tokens)
    return _reference_cache[key]


def engine_greedy(path, requests) -> dict:
    """{request id: token ids} of (request id, prompt, params) requests stepped through a fresh LLMEngine."""
    from engine import LLMEngine

    engine = LLMEngine(model=str(path))
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return finished


def hf_greedy(model, prompts, max_tokens) -> list[list[int]]:
    """A transformers model's greedy continuations of token-id `prompts`, one at a time (no padding), each
    exactly max_tokens[i] long (EOS ignored, as our side runs with ignore_eos)."""
    model.generation_config.eos_token_id = None
    outs = []
    for prompt, n in zip(prompts, max_tokens):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
            )
        outs.append(out[0, len(prompt) :].tolist())
    return outs


def assert_same(ours, expected):
    mismatched = [i for i, (a, b) in enumerate(zip(ours, expected)) if a != b]
    assert not mismatched, f"prompts {mismatched} differ from transformers"


def generate_greedy(llm, prompts, max_tokens):
    """`llm`'s greedy outputs of token-id `prompts` (EOS ignored), and their token ids."""
    from engine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return outs, [o.outputs[0].token_ids for o in outs]


def assert_exact_under_pressure(path, prompts, max_tokens, expected):
    """A 32-token budget and a pool too small for the batch, twice over the same prompts: each pass equals
    `expected`, the first preempts, and nothing leaks. Returns both passes' outputs (the caller checks
    what they read from the prefix cache)."""
    from engine import LLM

    llm = LLM(str(path), num_kv_blocks=40, max_num_batched_tokens=32)
    first, ours = generate_greedy(llm, prompts, max_tokens)
    assert_same(ours, expected)
    assert llm.llm_engine.stats["preemptions"] > 0
    again, ours = generate_greedy(llm, prompts, max_tokens)
    assert_same(ours, expected)
    assert_pool_free(llm.llm_engine)
    return first, again


# ---- batch-file lines ---------------------------------------------------------------------------


def assert_bf16_prompt_logprobs_close(path, llm) -> None:
    """`llm` (bfloat16) against transformers' float32 on the same checkpoint: each prompt token's logprob
    within 0.03 on average and within 0.1 at 95% of the positions (not all: bfloat16 rounding flips an
    MoE router's choice at a few; transformers' own bfloat16 differs there from its float32 by up to 0.7)."""
    from engine import SamplingParams

    prompts = [p for p in make_prompts(seed=5, count=6)[0] if len(p) > 1]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    diffs = []
    for out, prompt in zip(outs, prompts):
        with torch.no_grad():
            want = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
        got = [entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], prompt[1:])]
        diffs += [abs(g - want[i, tok].item()) for i, (g, tok) in enumerate(zip(got, prompt[1:]))]
    diffs = torch.tensor(diffs)
    assert len(diffs) > 300
    assert diffs.mean() < 0.03, diffs.mean()
    assert (diffs > 0.1).float().mean() < 0.05, sorted(diffs.tolist())[-20:]


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "How are you?"},
]


def chat_prompt_as_transformers(path, **llm_args) -> str:
    """`LLM.chat` on `CONVERSATION` gives the prompt ids transformers' `apply_chat_template` gives; their text."""
    from transformers import AutoTokenizer

    from engine import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(path)
    want = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    out = LLM(str(path), **llm_args).chat(CONVERSATION, SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert out.prompt_token_ids == want
    return tokenizer.decode(want)


def chat_line(custom_id: str, content: str, max_tokens: int = 4, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            **body,
        },
    }


def completion_line(custom_id: str, prompt: str, max_tokens: int = 4, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **body},
    }


def long_line(custom_id: str, content: str = "tell me a story", max_tokens: int = 48) -> dict:
    """A chat request that runs for `max_tokens` steps (EOS ignored), so a shard takes a while."""
    return chat_line(custom_id, content, max_tokens, ignore_eos=True)


def jsonl(lines) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


# ---- processes and ports ------------------------------------------------------------------------


def spawn(cmd: list[str], log, **kwargs) -> subprocess.Popen:
    """Start `cmd` with its output going to the file `log`."""
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **kwargs)


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float = 30, poll: float = 0.05, what="the condition"):
    """Poll `predicate()` until it returns something truthy, and return that; TimeoutError after `timeout`
    seconds. `what` names the wait in the error (a callable is called then, e.g. for a log's tail)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout}s for {what() if callable(what) else what}")
        time.sleep(poll)
    return value


def wait_for_log(proc, log: Path, text: str, timeout: float = 120) -> None:
    """Wait until `text` appears in the log of `proc` (a process started by `spawn`); fail at once if it exits."""

    def seen() -> bool:
        tail = log.read_text(errors="replace") if log.exists() else ""
        assert proc.poll() is None, f"exited with {proc.returncode} before {text!r}:\n{tail[-4000:]}"
        return text in tail

    wait_until(seen, timeout, 0.1, lambda: f"{text!r} in {log}:\n{log.read_text(errors='replace')[-4000:]}")


def wait_for(get, statuses=("completed", "failed", "cancelled", "expired"), timeout: float = 120, poll=0.2):
    """Poll `get()` (a job or batch object) until its status is one of `statuses`."""
    deadline = time.monotonic() + timeout
    while True:
        obj = get()
        if obj["status"] in statuses:
            return obj
        if time.monotonic() > deadline:
            raise TimeoutError(f"still {obj['status']} after {timeout}s: {obj}")
        time.sleep(poll)


def validated(client, response, timeout: float = 60) -> dict:
    """The job (or batch) a create `response` returned, re-read once the app's background validation of
    it finished (create answers `validating` at once)."""
    assert client.application.extensions["pagedbatch"].validations.wait(timeout), "validation still running"
    body = response.get_json()
    path = "/v1/batches/" if body["object"] == "batch" else "/v1/jobs/"
    return client.get(path + body["id"]).get_json()
