"""The runner of an encoder model (engine.hf.encoder_config): every input runs whole in one step, its
tokens packed end to end with the step's other inputs (no padding), attending bidirectionally to
itself (engine.models.encoder_attention). Nothing is cached: the KV pool the scheduler books blocks
in holds no memory, and prefix caching is off (a bidirectional prefix depends on what follows)."""

from __future__ import annotations

import logging

import torch
from safetensors import safe_open

from engine.core.block_manager import cdiv
from engine.core.scheduler import ScheduledBatch
from engine.hf.config import EngineConfig, resolve_model_path
from engine.hf.encoder_config import EncoderConfig, encoder_architecture
from engine.hf.loader import checkpoint_files
from engine.hf.model_info import read_config
from engine.models.bert import BertEncoderModel
from engine.models.encoder_attention import PackedBatch
from engine.models.modernbert import ModernBertEncoderModel
from engine.models.nomic_bert import NomicBertEncoderModel
from engine.runner.cpu_linear import can_pack, pack_linears, padded_rows, warm_packed_linears
from engine.runner.cpu_malloc import keep_freed_memory

log = logging.getLogger(__name__)

# On CPU a step runs in groups of whole inputs of about this many tokens. Large groups: fewer, larger
# parallel regions; on this shared 2-core machine 1024-token groups ran the real all-MiniLM-L6-v2 at 0.65x
# sentence-transformers' speed on 2 threads, 8192 at ~1.6x, ~2x with the fused GEMMs
# (bench.embeddings --model minilm).
CPU_GROUP_TOKENS = 8192


def load_encoder_config(
    model, max_model_len: int | None = None, revision: str | None = None, overrides: dict | None = None
) -> EncoderConfig | None:
    """The encoder config of `model`'s directory, or None for a model that is not an encoder."""
    path = resolve_model_path(model, revision)
    raw = {**read_config(path), **(overrides or {})}
    return EncoderConfig.from_dict(raw, path, max_model_len) if encoder_architecture(raw) else None


def build_encoder(cfg: EncoderConfig, device, dtype) -> torch.nn.Module:
    with torch.device(device):
        families = {"modernbert": ModernBertEncoderModel, "nomic_bert": NomicBertEncoderModel}
        model = families.get(cfg.family, BertEncoderModel)(cfg)
    model.to(dtype=dtype)
    load_encoder_weights(model, cfg)
    return model.eval()


def load_encoder_weights(model: torch.nn.Module, cfg: EncoderConfig) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    parts_of: dict[str, int] = {}  # a fused parameter's number of checkpoint parts
    for file in checkpoint_files(cfg.path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle is not a dict
                where = model.checkpoint_name(name)
                if where is None:
                    continue
                target, shard = where
                parts = 3
                if isinstance(shard, tuple):  # (index, of how many parts)
                    shard, parts = shard
                if target not in params:
                    raise ValueError(f"checkpoint weight {name!r} has no place in the {cfg.architecture} model")
                tensor = f.get_tensor(name)
                dst = params[target]
                if shard is not None:
                    parts_of[target] = parts
                    size = dst.shape[0] // parts
                    dst = dst.narrow(0, shard * size, size)
                if dst.shape != tensor.shape:
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
                with torch.no_grad():
                    dst.copy_(tensor.to(dst.dtype))
                loaded.add(target if shard is None else f"{target}#{shard}")
    missing = [
        n
        for n in params
        if n not in loaded and not (n in parts_of and all(f"{n}#{i}" in loaded for i in range(parts_of[n])))
    ]
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


class EncoderRunner:
    """What `LLMEngine` needs of a runner, for an encoder: `run` computes a step's pooled vectors
    (or classifier outputs) and hands them to each sequence's pooling state."""

    is_encoder = True
    has_lm_head = False
    graph_runner = None

    def __init__(self, config: EngineConfig, model_config: EncoderConfig, device: torch.device, dtype: torch.dtype):
        self.config, self.model_config, self.device, self.dtype = config, model_config, device, dtype
        config.enable_prefix_caching = False
        # a whole input runs in one step, so the step's budget holds the longest
        config.max_num_batched_tokens = max(config.max_num_batched_tokens, model_config.max_model_len)
        if device.type == "cpu":
            keep_freed_memory()
        self.model = build_encoder(model_config, device, dtype)
        self.pad_rows = can_pack(device, dtype)
        if self.pad_rows:
            pack_linears(self.model)
            warm_packed_linears(self.model, min(config.max_num_batched_tokens, CPU_GROUP_TOKENS))
        self.block_size = config.block_size
        # bookkeeping only: the scheduler books blocks, no memory stands behind them
        self.num_blocks = config.num_kv_blocks or config.max_num_seqs * cdiv(
            model_config.max_model_len, config.block_size
        )
        self.kv_caches: list = []

    def execute(self, batch, extra_rows=None):
        raise ValueError("an encoder model has no language-model head: it can only embed, classify or score")

    @torch.no_grad()
    def run(self, batch: ScheduledBatch) -> None:
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.num_computed_tokens != 0 or n != len(seq):
                raise RuntimeError("an encoder input must run whole in one step")
        group_tokens = CPU_GROUP_TOKENS if self.device.type == "cpu" else batch.num_tokens
        for group in _groups(batch.seqs, group_tokens):
            self._run_group(group)

    def _run_group(self, seqs) -> None:
        ids, types = [], []
        for seq in seqs:
            ids.extend(seq.token_ids)
            given = getattr(seq.pooling, "token_type_ids", None)
            types.extend(given if given is not None else [0] * len(seq))
        lengths = [len(s) for s in seqs]
        if self.pad_rows:  # the linear layers' row padding done once here (a dummy input nothing reads)
            extra = padded_rows(len(ids)) - len(ids)
            if extra:
                ids.extend([0] * extra)
                types.extend([0] * extra)
                lengths.append(extra)
        packed = PackedBatch(lengths).to(self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        token_types = torch.tensor(types, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, token_types, packed)
        classify = [i for i, s in enumerate(seqs) if s.pooling.classifies]
        logits = None
        if classify:
            if not self.model_config.classifier:
                raise RuntimeError("classify/score on a model without a classification head")
            logits = self.model.classify(hidden, packed).float()
        sums = _mean_sums(hidden, seqs, packed)
        for i, (seq, start) in enumerate(zip(seqs, packed.starts)):
            if seq.pooling.classifies:
                seq.pooling.take_logits(logits[i])
            elif sums is not None and seq.pooling.method == "MEAN":  # its rows' sum is what MEAN folds in
                seq.pooling.absorb_rows(sums[i : i + 1], 0, len(seq), len(seq))
            else:
                seq.pooling.absorb(hidden[start : start + len(seq)], 0, len(seq))


def _mean_sums(hidden: torch.Tensor, seqs, packed: PackedBatch) -> torch.Tensor | None:
    """[sequences, hidden] each input's sum of rows in one call (a call per input costs a parallel
    region each on a busy CPU), or None where no input mean-pools."""
    if not any(not s.pooling.classifies and s.pooling.method == "MEAN" for s in seqs):
        return None
    lengths = torch.tensor([len(s) for s in seqs], device=hidden.device)
    owner = torch.repeat_interleave(torch.arange(len(seqs), device=hidden.device), lengths)
    rows = hidden[: owner.shape[0]].float()
    return rows.new_zeros((len(seqs), rows.shape[1])).index_add_(0, owner, rows)


def _groups(seqs, group_tokens: int):
    group, tokens = [], 0
    for seq in seqs:
        if group and tokens + len(seq) > group_tokens:
            yield group
            group, tokens = [], 0
        group.append(seq)
        tokens += len(seq)
    if group:
        yield group
