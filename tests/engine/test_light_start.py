"""An engine starts without importing transformers or xgrammar (over a second between them): decoding and the
EOS id go through the light tokenizer, generation_config.json is read directly, xgrammar waits for the first
constrained request. A text prompt is tokenized by the light tokenizer too, to transformers' tokens; what needs
transformers' own tokenizer (`get_tokenizer`) loads it then."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import json, sys
from engine import LLM, SamplingParams

llm = LLM(sys.argv[1], num_kv_blocks=16)
engine = llm.llm_engine
from engine.core.contract import require_step_engine
require_step_engine(engine)  # what a worker's engine host checks before it takes shards
heavy_at_start = sorted(m for m in ("transformers", "xgrammar", "pandas") if m in sys.modules)
greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
by_ids = llm.generate([{"prompt_token_ids": [5, 9, 17, 3]}], greedy)[0].outputs[0]
heavy_after_ids = sorted(m for m in ("transformers", "xgrammar") if m in sys.modules)
by_text = llm.generate(["hello world"], greedy)[0]
heavy_after_text = sorted(m for m in ("transformers", "xgrammar") if m in sys.modules)
hf = llm.get_tokenizer()
print(json.dumps({
    "heavy_at_start": heavy_at_start,
    "heavy_after_ids": heavy_after_ids,
    "heavy_after_text": heavy_after_text,
    "text_matches": by_ids.text == hf.decode(list(by_ids.token_ids)),
    "prompt_ids": list(by_text.prompt_token_ids) == hf("hello world").input_ids,
    "hf_class": type(hf).__module__.split(".")[0],
    "eos": [engine.eos_token_id, hf.eos_token_id],
}))
"""


def test_engine_starts_and_tokenizes_text_without_transformers(tiny_model):
    path = tiny_model("qwen3")
    done = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["heavy_at_start"] == []
    assert result["heavy_after_ids"] == []
    assert result["heavy_after_text"] == []
    assert result["text_matches"] and result["prompt_ids"]
    assert result["hf_class"] == "transformers"
    assert result["eos"][0] == result["eos"][1] is not None


def test_generation_config_with_sampling_values_still_read_by_transformers(tmp_path):
    from engine.hf.generation_config import read_generation_config

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7], "temperature": 0.6}))
    read = read_generation_config(tmp_path, "auto")
    assert (read["eos_token_id"], read["temperature"]) == ([2, 7], 0.6)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "pad_token_id": 3}))
    assert read_generation_config(tmp_path, "auto") == {"eos_token_id": 2}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    assert read_generation_config(tmp_path, "auto") == {}
