"""The dense decoder of every family as one module with switches (`ModelConfig`'s family fields):
QKV bias (Qwen2), q/k RMSNorm per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2), tied
embeddings, any GQA ratio, per-layer sliding windows (Mistral, Gemma 2/3, Phi-3) and RoPE tables
(Gemma 3's local layers), soft-capped scores and logits (Gemma 2), a configurable attention scale,
partial rotary (Phi-3/4), attention sinks (gpt-oss), GELU-tanh MLPs and scaled embeddings (Gemma),
norms before (Llama), around (Gemma) or after (OLMo 2) each block, Granite's residual and logits
multipliers.

Q, K and V are one fused projection, as are gate and up; the loader packs the
checkpoint's separate weights into them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.hf.config import ModelConfig
from engine.models.rotary import cos_sin_cache
from engine.multimodal.bidirectional import attend_within_images
from engine.multimodal.mrope import mrope_cos_sin
from engine.runner.ops import Ops


@dataclass
class AttentionInputs:
    """Flat per-step tensors describing where each new token's K/V lives."""

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    # Optional host-side hints for kernels that take them (the Triton set; the torch reference
    # takes none): set, they are passed to paged_attention as keyword arguments. A CUDA-graph
    # decode sets all three so that the captured launches fit every replay.
    max_query_len: int | None = None
    max_seq_len: int | None = None
    attn_out: torch.Tensor | None = None  # [T, H, D] output buffer shared by every layer
    image_spans: list | None = None  # Gemma 3: images attended both ways (engine.multimodal.bidirectional)
    mrope_positions: torch.Tensor | None = None  # Qwen2.5-VL: [3, T] M-RoPE positions (engine.multimodal.mrope)

    def attention_kwargs(self) -> dict:
        hints = {"max_query_len": self.max_query_len, "max_seq_len": self.max_seq_len, "out": self.attn_out}
        return {k: v for k, v in hints.items() if v is not None}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: Ops):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x, residual=None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops: Ops):
        super().__init__()
        self.layer = layer
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else self.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.norm_whole = cfg.qk_norm_scope == "all"
        if cfg.qk_norm:
            q_dim, k_dim = (self.q_size, self.kv_size) if self.norm_whole else (self.head_dim, self.head_dim)
            self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps, ops)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_dim = cfg.rotary_dim or self.head_dim
        self.window = cfg.layer_windows[layer] if cfg.layer_windows else None
        self.local_rope = self.window is not None and cfg.local_rope is not None  # the model's local table
        kernel = {"window": self.window, "softcap": cfg.attn_softcap}
        self.kernel_args = {k: v for k, v in kernel.items() if v}  # plain layers pass none
        # gpt-oss: a learned logit per head in every softmax's denominator (passed to the kernel per call)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if cfg.attn_sinks else None

    def project_qkv(self, x: torch.Tensor, positions, cos_sin: torch.Tensor):
        """Queries, keys and values of `x` ([tokens, heads, head_dim]), normed and rotated."""
        return self.split_qkv(self.qkv_proj(x), positions, cos_sin)

    def split_qkv(self, qkv: torch.Tensor, positions, cos_sin: torch.Tensor):
        """`project_qkv` from the fused projection `qkv` (the lean pooling forward computes it itself)."""
        tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_dim == self.head_dim:
            q, k = self.ops.apply_rotary(q, k, positions, cos_sin)
        else:  # partial rotary: the first rotary_dim features of each head
            r = self.rotary_dim
            q_rot, k_rot = self.ops.apply_rotary(q[..., :r].contiguous(), k[..., :r].contiguous(), positions, cos_sin)
            q, k = torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
        return q, k, v

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.project_qkv(x, inputs.positions, cos_sin)
        k_cache, v_cache = inputs.kv_caches[self.layer]
        self.ops.write_kv_cache(k, v, k_cache, v_cache, inputs.slot_mapping)
        out = self.ops.paged_attention(
            q,
            k_cache,
            v_cache,
            inputs.block_tables,
            inputs.seq_lens,
            inputs.query_start_loc,
            self.scale,
            **inputs.attention_kwargs(),
            **self.kernel_args,
            **({} if self.sinks is None else {"sinks": self.sinks}),
        )
        if inputs.image_spans:
            out = attend_within_images(
                out.view(tokens, self.num_heads, self.head_dim),
                q,
                k_cache,
                v_cache,
                inputs.image_spans,
                self.scale,
                self.window,
            )
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = cfg.hidden_act

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.act == "silu":
            return self.down_proj(self.ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh" if self.act == "gelu_tanh" else "none") * up)


class DecoderLayer(nn.Module):
    """One block; returns (its output, the residual stream before it): the next block (or the final
    norm) adds them. Layouts: `pre` norms each block's input (Llama); `sandwich` also norms each
    block's output (Gemma's pre/post feed-forward norms); `post` norms only the outputs (OLMo 2)."""

    def __init__(
        self, cfg: ModelConfig, layer: int, ops: Ops, mlp: nn.Module | None = None, attention: nn.Module | None = None
    ):
        super().__init__()
        self.self_attn = Attention(cfg, layer, ops) if attention is None else attention
        self.mlp = MLP(cfg, ops) if mlp is None else mlp
        self.layout = cfg.norm_layout
        self.residual_multiplier = cfg.residual_multiplier
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        if self.layout != "post":
            self.input_layernorm = RMSNorm(size, eps, ops)
        self.post_attention_layernorm = RMSNorm(size, eps, ops)
        if self.layout == "sandwich":
            self.pre_feedforward_layernorm = RMSNorm(size, eps, ops)
        if self.layout != "pre":
            self.post_feedforward_layernorm = RMSNorm(size, eps, ops)

    def forward(self, x, residual, cos_sin, inputs):
        if self.layout == "post":
            return self._forward_post(x, residual, cos_sin, inputs)
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin, inputs)
        if self.layout == "sandwich":
            x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        return x, residual

    def _forward_post(self, x, residual, cos_sin, inputs):
        if residual is not None:
            x = x + residual
        x = x + self.post_attention_layernorm(self.self_attn(x, cos_sin, inputs))
        return self.post_feedforward_layernorm(self.mlp(x)), x


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, make_mlp=None, make_attention=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(
                cfg, i, ops, make_mlp and make_mlp(cfg, i, ops), make_attention and make_attention(cfg, i, ops)
            )
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)


class LlamaForCausalLM(nn.Module):
    """Packed checkpoint names: (our parameter, shard index) for each separate weight."""

    packed = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, ops: Ops):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, ops, self.make_mlp, self.make_attention)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        rotary = cfg.rotary_dim or cfg.head_dim
        cache = cos_sin_cache(rotary, cfg.max_model_len, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("cos_sin", cache, persistent=False)
        if cfg.local_rope is not None:  # Gemma 3's sliding layers: a base (and scaling) of their own
            local = {k: v for k, v in cfg.local_rope.items() if k != "rope_theta"}
            table = cos_sin_cache(
                rotary,
                cfg.max_model_len,
                cfg.local_rope["rope_theta"],
                local if local.get("rope_type", "default") != "default" else None,
            )
            self.register_buffer("cos_sin_local", table, persistent=False)
        # the lean pooling forward (engine.pooling.forward) knows the plain Llama block only
        self.plain_llama = cfg.norm_layout == "pre" and not (
            cfg.layer_windows
            or cfg.attn_softcap
            or cfg.final_softcap
            or cfg.embedding_scale
            or cfg.residual_multiplier != 1.0
            or cfg.logits_divisor != 1.0
            or cfg.hidden_act != "silu"
            or (cfg.rotary_dim or cfg.head_dim) != cfg.head_dim
            or cfg.qk_norm_scope != "head"
            or cfg.mla is not None
            or cfg.attn_sinks
        )

    make_mlp = None  # subclasses: (cfg, layer, ops) -> a layer's MLP, or None for the dense one
    make_attention = None  # subclasses: (cfg, layer, ops) -> a layer's attention (DeepSeek's latent one)

    def shard_sizes(self, packed_name: str) -> list[int]:
        cfg = self.cfg
        if packed_name == "qkv_proj":
            kv = cfg.num_kv_heads * cfg.head_dim
            return [cfg.num_heads * cfg.head_dim, kv, kv]
        return [cfg.intermediate_size, cfg.intermediate_size]

    def forward(self, input_ids: torch.Tensor, inputs: AttentionInputs, image_embeds=None) -> torch.Tensor:
        """Hidden states of every token, [T, hidden]. `image_embeds`: (rows, embeddings) put in place of
        those rows' token embeddings (an image's placeholders; engine.multimodal.step_embeds)."""
        x = self.model.embed_tokens(input_ids)
        scale = self.cfg.embedding_scale
        if scale is not None and scale != 1.0:
            x = x * (torch.tensor(scale, dtype=x.dtype) if self.cfg.embedding_scale_in_dtype else scale)
        if image_embeds is not None:
            x = x.index_copy(0, image_embeds[0], image_embeds[1].to(x.dtype))
        residual = None
        table = self.cos_sin
        if inputs.mrope_positions is not None:  # one rotary row per token, rotated by its row index
            table = mrope_cos_sin(self.cos_sin, inputs.mrope_positions, self.cfg.mrope_section)
            inputs = replace(inputs, positions=torch.arange(x.shape[0], device=x.device))
        for layer in self.model.layers:
            cos_sin = self.cos_sin_local if layer.self_attn.local_rope else table
            x, residual = layer(x, residual, cos_sin, inputs)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.cfg.logits_divisor != 1.0:
            logits = logits / self.cfg.logits_divisor
        if self.cfg.final_softcap:
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return logits

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint weight as this model holds it: Gemma's norms store w of (1 + w), folded here."""
        if self.cfg.norm_offset and name.endswith("norm.weight"):
            return tensor.float() + self.cfg.norm_offset
        return tensor
