"""Owns the model and the KV cache on the device; turns a scheduled batch into flat
tensors, runs the forward pass, and returns the logits of the sequences that sample.

On CUDA, decode-only steps are replayed from CUDA graphs (engine/cuda_graph.py); other
steps run eagerly. Either way nothing in a step waits for the device: inputs go up from
pinned memory asynchronously, and the only read back is the sampler's."""

from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig, ModelConfig
from engine.cpu_linear import can_pack, pack_linears, warm_packed_linears
from engine.cpu_malloc import keep_freed_memory
from engine.cuda_graph import DecodeGraphRunner, batch_size_ladder
from engine.device import to_device
from engine.loader import load_weights
from engine.models.factory import build_model
from engine.models.llama import AttentionInputs
from engine.ops import select_ops
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.warm_up import warm_memory, warm_up

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, device: torch.device,
                 dtype: torch.dtype):
        self.config = config
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.ops = select_ops(config.attention_backend, device)
        if device.type == "cpu":
            keep_freed_memory()
        with torch.device(device):
            model = build_model(model_config, self.ops)
        model.to(dtype=dtype)
        model.cos_sin = model.cos_sin.float()
        if hasattr(model, "cos_sin_local"):
            model.cos_sin_local = model.cos_sin_local.float()
        # A pooling runner serves base models (no LM head); generation is then refused.
        self.has_lm_head = load_weights(model, model_config.path, lm_head_optional=config.runner == "pooling")
        if can_pack(device, dtype):
            pack_linears(model)
            warm_packed_linears(model, config.max_num_batched_tokens)
        self.model = model.eval()
        self.num_blocks = config.num_kv_blocks or self._auto_num_blocks()
        shape = (self.num_blocks, self.block_size, model_config.num_kv_heads, model_config.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(model_config.num_layers)
        ]
        self.graph_runner = self._make_graph_runner()
        if self.ops.compiles_on_first_use:
            warm_up(self.model, model_config, self.block_size, device, dtype)
            warm_memory(self.model, model_config, self.block_size, device, dtype, config.max_num_batched_tokens,
                        config.max_num_seqs)

    @property
    def _captures_graphs(self) -> bool:
        """On CUDA with kernels that a graph can hold, unless told to stay eager."""
        cfg = self.config
        return (self.device.type == "cuda" and self.ops.graph_capturable and not cfg.enforce_eager
                and not cfg.static_decode_eager
                and self.model_config.moe is None)  # the grouped experts read their counts on the host

    def _graph_batch(self) -> int:
        """The largest decode batch served from the static buffers."""
        return batch_size_ladder(min(self.config.cuda_graph_max_batch or self.config.max_num_seqs,
                                     self.config.max_num_seqs))[-1]

    def _make_graph_runner(self) -> DecodeGraphRunner | None:
        if not (self._captures_graphs or self.config.static_decode_eager):
            return None
        runner = DecodeGraphRunner(
            self.model, self.kv_caches, max_batch=self._graph_batch(),
            max_model_len=self.model_config.max_model_len, block_size=self.block_size,
            device=self.device, dtype=self.dtype, attention_hints=self.ops.attention_hints,
        )
        if self._captures_graphs:
            runner.capture()
        return runner

    def _bytes_per_block(self) -> int:
        m = self.model_config
        return 2 * m.num_layers * self.block_size * m.num_kv_heads * m.head_dim * self.dtype.itemsize

    def _auto_num_blocks(self) -> int:
        if self.device.type == "cuda":
            budget = self._free_cuda_memory()
        else:
            budget = self.config.cpu_kv_cache_gb * (1 << 30)
        num_blocks = int(budget // self._bytes_per_block())
        # More blocks than every sequence at full length could use is wasted memory.
        useful = self.config.max_num_seqs * -(-self.model_config.max_model_len // self.block_size)
        num_blocks = min(num_blocks, useful)
        if num_blocks < 1:
            raise RuntimeError("not enough memory for even one KV block; lower max_num_batched_tokens")
        log.info("KV pool: %d blocks of %d tokens (%.2f GiB)", num_blocks, self.block_size,
                 num_blocks * self._bytes_per_block() / 2**30)
        return num_blocks

    def _free_cuda_memory(self) -> float:
        """Bytes left for the KV pool: gpu_memory_utilization of the card, less what is in use
        (this process's weights and CUDA context, and other processes), less the peak working
        memory of a step (profiled), less the CUDA graphs' memory pool (estimated from it)."""
        dev = self.device
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        tokens = self._profile_step()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        torch.cuda.empty_cache()  # otherwise the profile's freed blocks would count as used too
        free, total = torch.cuda.mem_get_info(dev)
        used = total - free
        # A decode graph holds the activations of up to _graph_batch() tokens for good, in a pool
        # of its own; activations grow linearly with tokens, so scale the profiled peak (2x margin).
        graphs = 2 * peak * min(1.0, self._graph_batch() / tokens) if self._captures_graphs else 0
        budget = total * self.config.gpu_memory_utilization - used - peak - graphs
        log.info("GPU memory: %.1f GiB total, %.1f in use, step peak %.2f, graphs %.2f, KV budget %.1f",
                 total / 2**30, used / 2**30, peak / 2**30, graphs / 2**30, budget / 2**30)
        return budget

    @torch.no_grad()
    def _profile_step(self) -> int:
        """A forward pass at the full token budget (writing no K/V), then sampling with every
        option on for max_num_seqs rows, to measure peak working memory. Returns the tokens run."""
        tokens = min(self.config.max_num_batched_tokens, self.model_config.max_model_len)
        m = self.model_config
        scratch = torch.empty((1, self.block_size, m.num_kv_heads, m.head_dim), dtype=self.dtype,
                              device=self.device)
        inputs = AttentionInputs(
            positions=torch.arange(tokens, device=self.device),
            slot_mapping=torch.full((tokens,), -1, dtype=torch.long, device=self.device),
            block_tables=torch.zeros((1, 1), dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([1], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=self.device),
            kv_caches=[(scratch, scratch)] * m.num_layers,
        )
        hidden = self.model(torch.zeros(tokens, dtype=torch.long, device=self.device), inputs)
        rows = min(tokens, self.config.max_num_seqs)
        logits = self.model.compute_logits(hidden[-rows:])
        del hidden
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                                presence_penalty=0.1, frequency_penalty=0.1, logprobs=20, seed=0)
        seqs = [Sequence(i, "profile", 0, [0, 1], params) for i in range(rows)]
        for seq in seqs:
            seq.append_token(2)
        Sampler(m.vocab_size, self.device, 0)(logits, seqs, [])
        return tokens

    @torch.no_grad()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (source, destination) in every layer: a forked beam's
        copy-on-write of its parent's partial block. Queued on the device like a step."""
        if not pairs:
            return
        src = to_device([s for s, _ in pairs], torch.long, self.device)
        dst = to_device([d for _, d in pairs], torch.long, self.device)
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, AttentionInputs, torch.Tensor]:
        input_ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
        sample_rows = []
        bs = self.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            starts.append(starts[-1] + n)
            if end == len(seq):
                sample_rows.append(starts[-1] - 1)
        max_blocks = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in batch.seqs]
        hints = {}
        if self.ops.attention_hints:
            hints = dict(max_query_len=max(batch.num_new_tokens), max_seq_len=max(seq_lens))
        dev = self.device
        inputs = AttentionInputs(
            positions=to_device(positions, torch.long, dev),
            slot_mapping=to_device(slots, torch.long, dev),
            block_tables=to_device(tables, torch.int32, dev),
            seq_lens=to_device(seq_lens, torch.int32, dev),
            query_start_loc=to_device(starts, torch.int32, dev),
            kv_caches=self.kv_caches,
            **hints,
        )
        return to_device(input_ids, torch.long, dev), inputs, to_device(sample_rows, torch.long, dev)

    @torch.no_grad()
    def execute(self, batch: ScheduledBatch, extra_rows: list[int] | None = None):
        """Logits [num sampling seqs, vocab] in batch order (seqs mid-prefill have none).

        With `extra_rows` (indices into the batch's flattened new tokens), returns
        (logits, the final hidden states of those rows) from the same forward pass."""
        if extra_rows:
            input_ids, inputs, sample_rows = self.prepare(batch)
            hidden = self.model(input_ids, inputs)
            extra = hidden[to_device(extra_rows, torch.long, self.device)]
            return self.model.compute_logits(hidden[sample_rows]), extra
        if self.graph_runner is not None and self.graph_runner.can_run(batch.num_new_tokens):
            hidden = self.graph_runner.run(batch.seqs)
            # A one-token chunk that does not finish its prompt has nothing to sample.
            rows = [i for i, s in enumerate(batch.seqs) if s.num_computed_tokens + 1 == len(s)]
            if len(rows) < len(batch.seqs):
                hidden = hidden[to_device(rows, torch.long, self.device)]
            return self.model.compute_logits(hidden)
        input_ids, inputs, sample_rows = self.prepare(batch)
        hidden = self.model(input_ids, inputs)
        return self.model.compute_logits(hidden[sample_rows])
