"""generation_config.json as vLLM reads it: its EOS ids stop generation, its sampling values are
the defaults of requests without params (unless generation_config="vllm"), per-request params win."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import LLM, SamplingParams

PROMPT = "0123"
DEFAULTS = {
    "do_sample": True,
    "temperature": 0.6,
    "top_k": 7,
    "top_p": 0.9,
    "repetition_penalty": 1.2,
    "max_new_tokens": 5,
}


@pytest.fixture(scope="module")
def eos_token(llm):
    """A token the greedy run emits early, made an EOS id by generation_config.json."""
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    ids = out[0].outputs[0].token_ids
    return ids, ids[3]


@pytest.fixture(scope="module")
def configured_dir(model_dir, eos_token, tmp_path_factory):
    path = tmp_path_factory.mktemp("genconfig") / "model"
    shutil.copytree(model_dir, path)
    _, eos = eos_token
    (path / "generation_config.json").write_text(json.dumps({**DEFAULTS, "eos_token_id": [2, eos]}))
    return path


def make(path, **kw):
    return LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=16, **kw)


def test_eos_from_generation_config_stops_generation(configured_dir, eos_token):
    base, eos = eos_token
    for setting in ("auto", "vllm"):  # vLLM reads the EOS ids either way
        llm = make(configured_dir, generation_config=setting)
        out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0].outputs[0]
        first = base.index(eos)
        assert out.token_ids == base[: first + 1] and out.finish_reason == "stop"
        assert out.stop_reason == eos  # not the tokenizer's EOS: a stop token id, as in vLLM
        ignored = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)[
            0
        ].outputs[0]
        assert ignored.token_ids == base


def test_defaults_apply_and_per_request_params_override(configured_dir):
    llm = make(configured_dir)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.repetition_penalty, defaults.max_tokens) == (
        0.6,
        7,
        0.9,
        1.2,
        5,
    )
    out = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 5  # max_new_tokens=5 applied
    own = llm.generate(PROMPT, SamplingParams(max_tokens=9, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(own.token_ids) == 9  # the request's own params replace the defaults


def test_vllm_setting_ignores_the_defaults_and_override_merges(configured_dir):
    assert make(configured_dir, generation_config="vllm").get_default_sampling_params() == SamplingParams()
    llm = make(configured_dir, override_generation_config={"temperature": 0.3, "max_new_tokens": 2})
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.3, 7, 2)


def test_generation_config_path(model_dir, configured_dir):
    llm = make(model_dir, generation_config=str(configured_dir))
    assert llm.get_default_sampling_params().max_tokens == 5
    assert make(model_dir).get_default_sampling_params() == SamplingParams()  # the tiny model sets none


def test_unreadable_generation_config_is_a_clear_error(model_dir, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(model_dir, path)
    (path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json"):
        make(path)
