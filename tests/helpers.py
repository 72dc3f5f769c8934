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


def reference(path, prompts, max_tokens):
    """transformers greedy continuations, one prompt at a time (no padding), memoised."""
    key = (str(path), tuple(map(tuple, prompts)), tuple(max_tokens))
    if key not in _reference_cache:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # our side runs with ignore_eos
        outs = []
        for prompt, n in zip(prompts, max_tokens):
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                     min_new_tokens=n, do_sample=False)
            outs.append(out[0, len(prompt):].tolist())
        _reference_cache[key] = outs
    return _reference_cache[key]


def assert_same(ours, expected):
    mismatched = [i for i, (a, b) in enumerate(zip(ours, expected)) if a != b]
    assert not mismatched, f"prompts {mismatched} differ from transformers"


# ---- batch-file lines ---------------------------------------------------------------------------


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
