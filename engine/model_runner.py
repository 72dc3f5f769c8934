"""Owns the model and the KV cache on the device; turns a scheduled batch into flat
tensors, runs the forward pass, and returns the logits of the sequences that sample."""

from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig, ModelConfig
from engine.loader import load_weights
from engine.models.llama import AttentionInputs, LlamaForCausalLM
from engine.ops import select_ops
from engine.scheduler import ScheduledBatch

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
        with torch.device(device):
            model = LlamaForCausalLM(model_config, self.ops)
        model.to(dtype=dtype)
        model.cos_sin = model.cos_sin.float()
        load_weights(model, model_config.path)
        self.model = model.eval()
        self.num_blocks = config.num_kv_blocks or self._auto_num_blocks()
        shape = (self.num_blocks, self.block_size, model_config.num_kv_heads, model_config.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(model_config.num_layers)
        ]

    def _bytes_per_block(self) -> int:
        m = self.model_config
        return 2 * m.num_layers * self.block_size * m.num_kv_heads * m.head_dim * self.dtype.itemsize

    def _auto_num_blocks(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._profile_forward()
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            peak_extra = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
            budget = total * self.config.gpu_memory_utilization - used - peak_extra
        else:
            budget = self.config.cpu_kv_cache_gb * (1 << 30)
        num_blocks = int(budget // self._bytes_per_block())
        # More blocks than every sequence at full length could use is wasted memory.
        useful = self.config.max_num_seqs * -(-self.model_config.max_model_len // self.block_size)
        num_blocks = min(num_blocks, useful)
        if num_blocks < 1:
            raise RuntimeError("not enough memory for even one KV block; lower max_num_batched_tokens")
        log.info("KV pool: %d blocks of %d tokens", num_blocks, self.block_size)
        return num_blocks

    @torch.no_grad()
    def _profile_forward(self) -> None:
        """A forward pass at the full token budget (writing no K/V) to measure activation memory."""
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
        self.model.compute_logits(hidden[-min(tokens, self.config.max_num_seqs):])

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

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, pin_memory=self.device.type == "cuda").to(
                self.device, non_blocking=True
            )

        inputs = AttentionInputs(
            positions=tensor(positions, torch.long),
            slot_mapping=tensor(slots, torch.long),
            block_tables=tensor(tables, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            query_start_loc=tensor(starts, torch.int32),
            kv_caches=self.kv_caches,
        )
        return tensor(input_ids, torch.long), inputs, tensor(sample_rows, torch.long)

    @torch.no_grad()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [num sampling seqs, vocab] in batch order (seqs mid-prefill have none)."""
        input_ids, inputs, sample_rows = self.prepare(batch)
        hidden = self.model(input_ids, inputs)
        return self.model.compute_logits(hidden[sample_rows])
