"""Compile the CPU engine's kernels when the model loads, not in its first steps (vLLM does the same):
one forward over a small batch holding every kind of row the kernels treat apart, and one over a
single token (a size of one compiles apart). Then one step as large as the token budget allows
(`warm_memory`), so that the first real one finds its working memory already mapped: the engine
keeps freed memory (`engine.runner.cpu_malloc`), and a first 8,192-token step spent half its time in page
faults otherwise. All run on scratch K/V: the pool is not touched."""

from __future__ import annotations

import logging

import torch

from engine.hf.config import ModelConfig
from engine.models.llama import AttentionInputs, LlamaForCausalLM
from engine.runner.cpu_malloc import heap_bytes, prefault
from pagedbatch_kernels.compiled import compiling_everything

log = logging.getLogger(__name__)
LONG_PROMPT = 96  # longer than the chunks the decode kernels take
PREFAULT_SHARE = 1  # heap mapped beyond the budget step's peak, in shares of that step's growth


def _batch(block_size: int, max_len: int) -> list[tuple[int, int, list[int]]]:
    """(context length with the new tokens, new tokens, block table) per sequence: two decodes
    sharing their first two blocks, a decode alone, a short chunk after a cached prefix (its rows
    share one block), a long prompt. Every table holds the blocks its context needs, whatever the
    block size (block 0 stays unused)."""
    after_shared = max(2 * block_size + 1, 3 * block_size - 8)  # reads a third block of its own
    lengths = [
        (min(after_shared, max_len), 1),
        (min(max(2 * block_size + 1, 3 * block_size - 12), max_len), 1),
        (min(5, max_len), 1),
        (min(block_size + 4, max_len), 3),
        (min(LONG_PROMPT, max_len), min(LONG_PROMPT, max_len)),
    ]
    shared, next_block, seqs = [1, 2], 3, []
    for i, (length, q_len) in enumerate(lengths):
        own = shared if i < 2 else []
        needed = max(0, -(-length // block_size) - len(own))
        seqs.append((length, min(q_len, length), own + list(range(next_block, next_block + needed))))
        next_block += needed
    return seqs


def _inputs(
    seqs, num_layers: int, scratch: tuple[torch.Tensor, torch.Tensor], device
) -> tuple[torch.Tensor, AttentionInputs]:
    width = max(len(t) for _, _, t in seqs)
    positions, starts = [], [0]
    for length, q_len, _ in seqs:
        positions.extend(range(length - q_len, length))
        starts.append(starts[-1] + q_len)
    tokens = len(positions)
    inputs = AttentionInputs(
        positions=torch.tensor(positions, device=device),
        slot_mapping=torch.full((tokens,), -1, dtype=torch.long, device=device),  # nothing written
        block_tables=torch.tensor([t + [0] * (width - len(t)) for _, _, t in seqs], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n for n, _, _ in seqs], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        kv_caches=[scratch] * num_layers,
    )
    return torch.zeros(tokens, dtype=torch.long, device=device), inputs


@torch.no_grad()
def warm_up(
    model: LlamaForCausalLM, cfg: ModelConfig, block_size: int, device: torch.device, dtype: torch.dtype
) -> None:
    seqs = _batch(block_size, cfg.max_model_len)
    num_blocks = 1 + max(max(t) for _, _, t in seqs)
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    scratch = (torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype))
    with compiling_everything():  # small calls run eagerly, large ones must not compile mid-run
        for batch in (seqs, seqs[2:3]):
            input_ids, inputs = _inputs(batch, cfg.num_layers, scratch, device)
            hidden = model(input_ids, inputs)
            model.compute_logits(hidden[-len(batch) :])
    log.debug("CPU kernels compiled for %s", dtype)


@torch.no_grad()
def warm_memory(
    model: LlamaForCausalLM,
    cfg: ModelConfig,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    max_tokens: int,
    max_rows: int,
) -> int:
    """One forward of `max_tokens` prompt tokens (prompts of at most the context each) on scratch
    K/V, and the logits of `max_rows` of them; returns the tokens run."""
    seqs, start = [], 1  # block 0 stays unused
    for first in range(0, max_tokens, cfg.max_model_len):
        length = min(cfg.max_model_len, max_tokens - first)
        blocks = -(-length // block_size)
        seqs.append((length, length, list(range(start, start + blocks))))
        start += blocks
    shape = (start, block_size, cfg.num_kv_heads, cfg.head_dim)
    scratch = (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
    input_ids, inputs = _inputs(seqs, cfg.num_layers, scratch, device)
    before = heap_bytes()
    hidden = model(input_ids, inputs)
    model.compute_logits(hidden[-min(max_rows, hidden.shape[0]) :])
    del hidden, scratch, inputs
    # Real steps of that size (many sequences, shared prefixes) use more: as much again, mapped now.
    # The heap's growth, not the peak resident size's: compiling at load may have set a higher peak.
    prefault(PREFAULT_SHARE * (heap_bytes() - before))
    return len(input_ids)
