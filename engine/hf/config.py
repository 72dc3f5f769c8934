"""Model and engine configuration."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.hf.deepseek_config import DEEPSEEK_ARCHITECTURES, MLAConfig, deepseek_settings
from engine.hf.model_families import family_settings, mrope_section, rope_parameters, text_config
from engine.hf.model_info import context_length, read_config
from engine.hf.moe_config import MOE_ARCHITECTURES, MoEConfig, moe_settings
from engine.multimodal.families import MULTIMODAL_FAMILIES

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # base models without an LM head, as sentence-transformers saves them (pooling only)
    "LlamaModel": "llama",
    "MistralModel": "mistral",
    "Qwen2Model": "qwen2",
    "Qwen3Model": "qwen3",
    # dense families beyond Llama (issue 31): switches of the same decoder (engine/hf/model_families.py)
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # with its vision tower (engine/multimodal)
    "Phi3ForCausalLM": "phi3",
    "Olmo2ForCausalLM": "olmo2",
    "GraniteForCausalLM": "granite",
    "Mistral3ForConditionalGeneration": "mistral",  # the text model; the vision tower is not loaded
    **MOE_ARCHITECTURES,  # mixture of experts (engine/hf/moe_config.py)
    **DEEPSEEK_ARCHITECTURES,  # latent attention and grouped routers (engine/hf/deepseek_config.py)
}


def resolve_model_path(model: str | Path, revision: str | None = None) -> Path:
    """A local directory as is; anything else is treated as a Hugging Face hub id."""
    path = Path(model)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"model path {model!r} is a file; expected a model directory")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.jinja"]
        return Path(snapshot_download(str(model), revision=revision, allow_patterns=patterns))
    except Exception as exc:  # any hub failure becomes one clear error
        raise ValueError(f"model {model!r} is not a local directory and could not be fetched: {exc}") from exc


@dataclass
class ModelConfig:
    """The subset of a Hugging Face `config.json` the engine needs."""

    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_model_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    eos_token_ids: list[int]
    torch_dtype: str | None
    # --- dense family switches (issue 31), set by engine.hf.model_families.family_settings ---
    hidden_act: str = "silu"  # silu | gelu_tanh | gelu
    layer_windows: tuple = ()  # per layer: its sliding window, or None (full attention); () none at all
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2: scores s -> c * tanh(s / c)
    final_softcap: float | None = None  # Gemma 2: logits likewise
    embedding_scale: float | None = None  # Gemma: sqrt(hidden); Granite: embedding_multiplier
    embedding_scale_in_dtype: bool = False  # Gemma: the scale rounded to the activations' dtype first
    norm_offset: float = 0.0  # Gemma: RMSNorm weights are (offset + w)
    norm_layout: str = "pre"  # pre (Llama) | sandwich (Gemma: pre and post norms) | post (OLMo 2)
    qk_norm_scope: str = "head"  # head (Qwen3, Gemma 3) | all (OLMo 2: over the whole projection)
    residual_multiplier: float = 1.0  # Granite
    logits_divisor: float = 1.0  # Granite's logits_scaling
    rotary_dim: int | None = None  # partial rotary (Phi-3/4); None: head_dim
    attn_sinks: bool = False  # gpt-oss: a learned logit per head joins each softmax's denominator
    local_rope: dict | None = None  # Gemma 3: the sliding layers' {"rope_theta", "rope_type", ...}
    moe: MoEConfig | None = None  # the experts of a mixture-of-experts family
    mla: MLAConfig | None = None  # DeepSeek's latent attention: one cache entry per token and layer
    multimodal: dict | None = None  # an image-text wrapper's whole config.json (engine/multimodal); None: text only
    mrope_section: tuple | None = None  # Qwen2.5-VL: rotary frequencies per position axis (t, h, w)

    @classmethod
    def load(
        cls,
        model: str | Path,
        max_model_len: int | None = None,
        revision: str | None = None,
        overrides: dict | None = None,
    ) -> ModelConfig:
        path = resolve_model_path(model, revision)
        return cls.from_dict({**read_config(path), **(overrides or {})}, path, max_model_len)

    @classmethod
    def from_dict(cls, raw: dict, path: Path, max_model_len: int | None = None) -> ModelConfig:
        wrapper = raw if any(a in MULTIMODAL_FAMILIES for a in raw.get("architectures") or []) else None
        raw = text_config(raw)
        archs = raw.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if raw.get("mlp_bias"):
            raise ValueError("models with mlp_bias=True are not supported")
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        head_dim = raw.get("head_dim") or hidden // num_heads
        rope = _rope_settings(raw)
        eos = raw.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        cfg = cls(
            path=path,
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.pop("rope_theta"),
            rope_scaling=rope or None,
            max_model_len=context_length(raw, max_model_len),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2"
            or (arch == "qwen2_moe" and raw.get("qkv_bias", True))
            or bool(raw.get("attention_bias", False)),
            o_bias=arch not in ("qwen2", "qwen3", "phi3", "qwen2_moe", "qwen3_moe")
            and bool(raw.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "gemma3", "olmo2", "qwen3_moe"),
            eos_token_ids=eos_ids,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            moe=moe_settings(raw, arch, raw["num_hidden_layers"]),
            multimodal=wrapper,
            mrope_section=mrope_section(raw) if wrapper is not None else None,
            **family_settings(raw, arch, head_dim),
        )
        return replace(cfg, **deepseek_settings(raw, arch, cfg.rope_scaling))

    @property
    def kv_tensors_per_layer(self) -> int:
        """K and V pools per layer; one for latent attention (its entries are read as both)."""
        return 1 if self.mla is not None else 2


def _rope_settings(raw: dict) -> dict:
    """rope_theta plus scaling (of the full-attention layers), whether written as `rope_scaling`
    (transformers 4) or `rope_parameters` (transformers 5). Returns {"rope_theta": ..., **scaling}."""
    merged = rope_parameters(raw)
    merged.pop("partial_rotary_factor", None)
    merged.pop("mrope_section", None)
    if merged["rope_type"] == "default":
        return {"rope_theta": merged["rope_theta"]}
    return merged


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    seed: int | None = 0  # None: a random seed
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 1.0
    attention_backend: str = "auto"
    # CUDA graphs for decode-only steps (see engine/runner/cuda_graph.py).
    enforce_eager: bool = False  # never capture: every step runs eagerly, unpadded
    cuda_graph_max_batch: int | None = None  # largest captured batch; None: min(max_num_seqs, 512)
    # Testing: run decode-only steps through the graphs' padded static buffers, eagerly and
    # without capturing, on any device (so that CPU tests cover the graph path's logic).
    static_decode_eager: bool = False
    # vLLM's model-loading options.
    tokenizer: str | None = None  # a tokenizer directory or hub id other than the model's
    tokenizer_mode: str = "auto"  # auto (or hf): the fast tokenizer when there is one; slow: the Python one
    revision: str | None = None  # hub revision of the model (and of its tokenizer unless tokenizer_revision)
    tokenizer_revision: str | None = None
    hf_overrides: dict | None = None  # merged over config.json
    generation_config: str = "auto"  # auto | vllm | a directory with generation_config.json
    override_generation_config: dict | None = None  # merged over generation_config.json's defaults
    max_logprobs: int = 20  # most logprobs / prompt_logprobs a request may ask for; -1: the vocabulary
    # vLLM's runner: generate, pooling (embeddings), or auto (pooling for a sentence-transformers directory)
    runner: str = "auto"
    grammar_cache_size: int = 256  # compiled structured-output grammars kept (least recently used out)
    scheduling_policy: str = "fcfs"  # vLLM's: fcfs, or priority (a request's priority, lower first)
    # vLLM's quantization: None reads the checkpoint's quantization_config; a method name must match it
    # ("fp8" also quantizes an unquantized checkpoint at load); see docs/quantization.md
    quantization: str | None = None
    # Images (engine/multimodal): vLLM's per-prompt limit ({"image": n}), the vision encoder's output cache
    # and per-call batch (in image tokens), and the networks an http(s) image URL may reach despite the guard.
    limit_mm_per_prompt: dict | None = None
    mm_encoder_cache_tokens: int = 16384
    mm_encoder_batch_tokens: int = 8192
    image_fetch_allowed_networks: tuple = ()
    # vLLM's multi-LoRA options (engine/lora/): adapters per step, their largest rank, adapters kept in memory
    enable_lora: bool = False
    max_loras: int | None = None  # None: 1 (vLLM's default)
    max_lora_rank: int | None = None  # None: 16 (vLLM's default)
    max_cpu_loras: int | None = None  # None: max_loras
    tensor_parallel_size: int = 1  # ranks (processes, one GPU each) the model is split across (engine/parallel)
    # vLLM's async scheduling (engine/core/async_steps.py): the next step is scheduled while the device runs
    # this one. None: on where the device runs apart from the host (CUDA); the CPU computes inside the step.
    async_scheduling: bool | None = None

    def __post_init__(self):
        if self.seed is None:  # vLLM: no seed, no reproducibility
            self.seed = int.from_bytes(os.urandom(7), "little")
        if self.tokenizer_mode not in ("auto", "hf", "slow"):
            raise ValueError(f"tokenizer_mode={self.tokenizer_mode!r} is not supported; use auto, hf or slow")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError("hf_overrides must be a dict merged over config.json (callables are not supported)")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0 or -1, got {self.max_logprobs!r}")
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner={self.runner!r} is not supported; use auto, generate or pooling")
        if not isinstance(self.grammar_cache_size, int) or self.grammar_cache_size < 1:
            raise ValueError(f"grammar_cache_size must be a positive integer, got {self.grammar_cache_size!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r} is not supported; use fcfs or priority")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.cuda_graph_max_batch is not None and self.cuda_graph_max_batch < 1:
            raise ValueError("cuda_graph_max_batch must be >= 1")
        self.max_loras = 1 if self.max_loras is None else self.max_loras
        self.max_lora_rank = 16 if self.max_lora_rank is None else self.max_lora_rank
        for name in ("max_loras", "max_lora_rank"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras!r}) must be an integer >= max_loras ({self.max_loras})"
            )


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        if checkpoint_dtype in ("float16", "bfloat16"):
            return getattr(torch, checkpoint_dtype)
        return torch.bfloat16
    names = {
        "float32": torch.float32,
        "float": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "half": torch.float16,
    }
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; expected auto, float32, bfloat16 or float16")
    return names[dtype]
