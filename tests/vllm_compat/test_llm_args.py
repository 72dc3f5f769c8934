"""vLLM's LLM(...) arguments: accepted with vLLM's meaning, as documented no-ops, or refused by name."""

from __future__ import annotations

import inspect
import shutil

import pytest

from engine import LLM, SamplingParams


def test_common_vllm_constructor_arguments_are_accepted(model_dir, tmp_path):
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tokenizer_dir / name)
    llm = LLM(
        model=str(model_dir),
        tensor_parallel_size=1,
        trust_remote_code=True,
        tokenizer=str(tokenizer_dir),
        tokenizer_mode="auto",
        revision=None,
        max_logprobs=5,
        enable_chunked_prefill=True,
        disable_log_stats=True,
        swap_space=4,
        generation_config="vllm",
        hf_overrides={"max_position_embeddings": 128},
        seed=None,
        device="cpu",
        dtype="float32",
        num_kv_blocks=16,
        gpu_memory_utilization=0.5,
        enforce_eager=True,
        max_model_len=None,
        quantization=None,
        kv_cache_dtype="auto",
        task="generate",
        allowed_local_media_path="",
    )
    assert llm.llm_engine.max_model_len == 128  # hf_overrides reached config.json
    out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_seed_none_is_not_reproducible_but_a_seed_is(model_dir):
    def sample(seed):
        llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=8, seed=seed)
        params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
        return llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids

    assert sample(3) == sample(3)
    assert len({tuple(sample(None)) for _ in range(3)}) > 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer, got 0"),
        (dict(pipeline_parallel_size=2), "pipeline_parallel_size"),
        (dict(quantization="awq"), "quantization"),
        (dict(scheduling_policy="lottery"), "scheduling_policy='lottery' is not supported; use fcfs or priority"),
        (dict(tokenizer_mode="mistral"), "tokenizer_mode"),
        (dict(hf_overrides=lambda c: c), "hf_overrides"),
        (dict(max_logprobs=-3), "max_logprobs"),
        (dict(generation_config="/nonexistent"), "generation_config"),
        (dict(not_an_argument=1), "unknown LLM argument 'not_an_argument'"),
        (dict(allowed_local_media_path="/srv/images"), "allowed_local_media_path='/srv/images' .*file://"),
    ],
)
def test_refused_arguments_name_themselves(model_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(model_dir), device="cpu", num_kv_blocks=4, **kwargs)


def test_use_tqdm_defaults_to_true_as_in_vllm(llm, capsys):
    assert inspect.signature(LLM.generate).parameters["use_tqdm"].default is True
    assert inspect.signature(LLM.chat).parameters["use_tqdm"].default is True
    llm.generate("Hello", SamplingParams(max_tokens=2))
    assert "Processed prompts" in capsys.readouterr().err


def test_priority_lora_and_metrics(llm):
    params = SamplingParams(temperature=0.0, max_tokens=2)
    assert len(llm.generate(["a", "b"], params, use_tqdm=False, priority=[0, 0])) == 2
    # vLLM V1, under its default fcfs: any integer priority is accepted and changes nothing
    assert len(llm.generate(["a", "b"], params, use_tqdm=False, priority=[1, 0])) == 2
    with pytest.raises(ValueError, match="enable_lora=True"):  # vLLM: LoRA must be enabled first
        llm.generate("a", params, use_tqdm=False, lora_request=object())


def test_get_metrics(model_dir):
    from engine.entrypoints.llm_metrics import Counter, Gauge

    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=16)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}], params, use_tqdm=False)
    metrics = {(m.name, tuple(m.labels.items())): m for m in llm.get_metrics()}
    assert metrics[("vllm:prompt_tokens", ())] == Counter("vllm:prompt_tokens", {}, 5)
    assert metrics[("vllm:generation_tokens", ())].value == 6
    assert metrics[("vllm:request_success", (("finished_reason", "length"),))].value == 2
    assert metrics[("vllm:num_requests_running", ())] == Gauge("vllm:num_requests_running", {}, 0)
    assert metrics[("vllm:kv_cache_usage_perc", ())].value == 0.0


def test_reset_prefix_cache(llm):
    prompt = {"prompt_token_ids": list(range(40, 90))}
    params = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(prompt, params, use_tqdm=False)
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 48
    assert llm.reset_prefix_cache() is True
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0
    engine = llm.llm_engine
    engine.add_request("busy", prompt, params)
    engine.step()
    assert llm.reset_prefix_cache() is False  # as vLLM: not while blocks are in use
    while engine.has_unfinished_requests():
        engine.step()
