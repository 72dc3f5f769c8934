"""Random-weight PEFT LoRA adapters written on the fly (B initialised non-zero, so that every adapter
changes the output), and PEFT's own greedy continuations over the same base model as the reference."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from tests.helpers import hf_greedy

# Three adapters of different ranks and target modules; one scaled by rsLoRA.
ADAPTERS = {
    "attn-qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-rslora": dict(
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "mlp-o": dict(r=2, lora_alpha=4, target_modules=["o_proj", "up_proj", "down_proj"]),
}


def write_adapter(base_path, out_dir, seed: int = 0, scale: float = 0.3, **lora_config):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **lora_config))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.normal_(0.0, scale)
    peft_model.save_pretrained(str(out_dir))
    return out_dir


def write_adapters(base_path, root) -> dict[str, str]:
    """The ADAPTERS under `root`: {name: directory}."""
    dirs = {}
    for seed, (name, config) in enumerate(ADAPTERS.items(), 1):
        dirs[name] = str(write_adapter(base_path, root / name, seed=seed, **config))
    return dirs


_cache: dict = {}


def peft_reference(base_path, adapter_dir, prompts, max_tokens):
    """Greedy continuations of PeftModel over the base (`adapter_dir` None: the base alone), one prompt at a
    time, memoised."""
    key = (str(base_path), adapter_dir, tuple(map(tuple, prompts)), tuple(max_tokens))
    if key not in _cache:
        model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
        if adapter_dir is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter_dir)
        _cache[key] = hf_greedy(model.eval(), prompts, max_tokens)
    return _cache[key]
