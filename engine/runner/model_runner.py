"""Owns the model and the KV cache on the device; turns a scheduled batch into flat
tensors, runs the forward pass, and returns the logits of the sequences that sample.

On CUDA, decode-only steps are replayed from CUDA graphs (engine/runner/cuda_graph.py); other
steps run eagerly. Either way nothing in a step waits for the device: inputs go up from
pinned memory asynchronously, and the only read back is the sampler's."""

from __future__ import annotations

import logging

import torch

from engine.core.scheduler import ScheduledBatch
from engine.core.sequence import Sequence
from engine.hf.config import EngineConfig, ModelConfig
from engine.hf.loader import load_weights
from engine.models.factory import build_model
from engine.models.llama import AttentionInputs
from engine.models.moe import Experts
from engine.multimodal.bidirectional import image_spans
from engine.multimodal.mrope import step_positions
from engine.multimodal.setup import make_step_embeds
from engine.params.sampling_params import SamplingParams
from engine.quant.model import quantize_model, weight_bytes
from engine.runner.block_tables import BlockTableRows
from engine.runner.cpu_linear import can_pack, pack_linears, warm_packed_linears
from engine.runner.cpu_malloc import keep_freed_memory
from engine.runner.cpu_threads import StepThreads
from engine.runner.cuda_graph import DecodeGraphRunner, batch_size_ladder
from engine.runner.device import to_device, zeros
from engine.runner.kv_prefault import PREFAULT_BYTES, KVPrefault
from engine.runner.ops import select_ops
from engine.runner.step_plan import plan_step, step_tensors
from engine.runner.warm_up import warm_memory, warm_up
from engine.sampling.sampler import Sampler
from pagedbatch_kernels import startup

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype):
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
        for module in model.modules():  # DeepSeek's routers, float32 as transformers keeps them
            if getattr(module, "keeps_float32", False):
                module.float()
        model.cos_sin = model.cos_sin.float()
        if hasattr(model, "cos_sin_local"):
            model.cos_sin_local = model.cos_sin_local.float()
        self.quantization = quantize_model(
            model, model_config.path, config.quantization, dtype, device, kernel=self.ops.quant_matmul
        )
        # A pooling runner serves base models (no LM head); generation is then refused.
        self.has_lm_head = self._load_weights(model)
        self.weight_bytes = weight_bytes(model)  # as loaded, before the CPU's packed copies
        log.info(
            "weights: %.1f MiB resident%s",
            self.weight_bytes / 2**20,
            f" ({self.quantization.method})" if self.quantization else "",
        )
        if can_pack(device, dtype):
            pack_linears(model)
            if not startup.quick():  # else oneDNN builds each size's primitive at its first use
                warm_packed_linears(model, config.max_num_batched_tokens)
        self.lora = None  # the adapters' slots (engine.lora.slots) when enable_lora
        if config.enable_lora:
            from engine.lora.slots import LoRASlots

            self.lora = LoRASlots(model, config.max_loras, config.max_lora_rank, config.max_cpu_loras, device, dtype)
        self.model = model.eval()
        self.step_threads = (
            StepThreads(_matmul_weights(model), self._kv_per_position()) if device.type == "cpu" else None
        )
        self.images = make_step_embeds(model_config, config, device, dtype)  # None for a text-only model
        self.num_blocks = config.num_kv_blocks or self._auto_num_blocks()
        if config.num_kv_blocks:
            log.info("KV pool: %d blocks of %d tokens (num_kv_blocks)", self.num_blocks, self.block_size)
        self.kv_caches = [self._layer_pools() for _ in range(model_config.num_layers)]
        self.kv_prefault = self._make_kv_prefault() if device.type == "cpu" else None
        self.graph_runner = self._make_graph_runner()
        width = -(-model_config.max_model_len // self.block_size)
        self.block_table_rows = BlockTableRows(config.max_num_seqs, width)  # the step's tables, kept between steps
        if self.ops.compiles_on_first_use and not startup.quick():  # a quick start compiles nothing up front
            warm_up(self.model, model_config, self.block_size, device, dtype)
            warm_memory(
                self.model,
                model_config,
                self.block_size,
                device,
                dtype,
                config.max_num_batched_tokens,
                config.max_num_seqs,
            )

    def _load_weights(self, model) -> bool:
        return load_weights(model, self.model_config.path, lm_head_optional=self.config.runner == "pooling")

    def finish_startup(self) -> bool:
        """On a deferred start (`pagedbatch_kernels.startup`), what a full one does at load, now (the
        engine is idle): every kernel compiled and timed, the working memory mapped. True if it did."""
        if not startup.deferred():
            return False
        startup.use("full")
        if can_pack(self.device, self.dtype):
            warm_packed_linears(self.model, self.config.max_num_batched_tokens)
        if self.ops.compiles_on_first_use:
            cfg = self.model_config
            warm_up(self.model, cfg, self.block_size, self.device, self.dtype)
            warm_memory(
                self.model,
                cfg,
                self.block_size,
                self.device,
                self.dtype,
                self.config.max_num_batched_tokens,
                self.config.max_num_seqs,
            )
        return True

    @property
    def _captures_graphs(self) -> bool:
        """On CUDA with kernels that a graph can hold, unless told to stay eager."""
        cfg = self.config
        return (
            self.device.type == "cuda"
            and self.ops.graph_capturable
            and not cfg.enforce_eager
            and not cfg.static_decode_eager
            and not cfg.enable_lora  # a step's adapters are set per step
            and self.model_config.moe is None
        )  # the grouped experts read their counts on the host

    def _graph_batch(self) -> int:
        """The largest decode batch served from the static buffers."""
        return batch_size_ladder(
            min(self.config.cuda_graph_max_batch or self.config.max_num_seqs, self.config.max_num_seqs)
        )[-1]

    def _make_graph_runner(self) -> DecodeGraphRunner | None:
        if not (self._captures_graphs or self.config.static_decode_eager) or self.config.enable_lora:
            return None
        if self.model_config.mrope_section:  # decode positions carry each prompt's M-RoPE delta
            return None
        runner = DecodeGraphRunner(
            self.model,
            self.kv_caches,
            max_batch=self._graph_batch(),
            max_model_len=self.model_config.max_model_len,
            block_size=self.block_size,
            device=self.device,
            dtype=self.dtype,
            attention_hints=self.ops.attention_hints,
        )
        if self._captures_graphs:
            runner.capture()
        return runner

    def _layer_pools(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's (K, V) pools; latent attention's one pool serves as both."""
        m = self.model_config
        shape = (self.num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        pools = [zeros(shape, self.dtype, self.device) for _ in range(m.kv_tensors_per_layer)]
        return pools[0], pools[-1]

    def _make_kv_prefault(self) -> KVPrefault:
        """The pool's pages mapped two steps' blocks ahead of use (at most PREFAULT_BYTES), from now on."""
        pools = list({id(t): t for pair in self.kv_caches for t in pair}.values())  # latent attention: K is V
        per_step = -(-self.config.max_num_batched_tokens // self.block_size) + self.config.max_num_seqs
        ahead = max(1, min(2 * per_step, PREFAULT_BYTES // self._bytes_per_block()))
        prefault = KVPrefault(pools, self.num_blocks, ahead)
        prefault.ensure(0)
        return prefault

    def _kv_per_position(self) -> int:
        m = self.model_config
        return m.kv_tensors_per_layer * m.num_layers * m.num_kv_heads * m.head_dim

    def _bytes_per_block(self) -> int:
        return self._kv_per_position() * self.block_size * self.dtype.itemsize

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
        log.info(
            "KV pool: %d blocks of %d tokens (%.2f GiB)",
            num_blocks,
            self.block_size,
            num_blocks * self._bytes_per_block() / 2**30,
        )
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
        log.info(
            "GPU memory: %.1f GiB total, %.1f in use, step peak %.2f, graphs %.2f, KV budget %.1f",
            total / 2**30,
            used / 2**30,
            peak / 2**30,
            graphs / 2**30,
            budget / 2**30,
        )
        return budget

    @torch.no_grad()
    def _profile_step(self) -> int:
        """A forward pass at the full token budget (writing no K/V), then sampling with every
        option on for max_num_seqs rows, to measure peak working memory. Returns the tokens run."""
        tokens = min(self.config.max_num_batched_tokens, self.model_config.max_model_len)
        m = self.model_config
        scratch = torch.empty((1, self.block_size, m.num_kv_heads, m.head_dim), dtype=self.dtype, device=self.device)
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
        params = SamplingParams(
            temperature=1.0,
            top_k=50,
            top_p=0.9,
            min_p=0.05,
            repetition_penalty=1.1,
            presence_penalty=0.1,
            frequency_penalty=0.1,
            logprobs=20,
            seed=0,
        )
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

    def prepare(
        self, batch: ScheduledBatch, has_images: bool = False, feed=None
    ) -> tuple[torch.Tensor, AttentionInputs, torch.Tensor]:
        if self.lora is not None:
            self.lora.begin_step([s.lora_id for s in batch.seqs], batch.num_new_tokens)
        input_ids, inputs, sample_rows = step_tensors(
            plan_step(batch, self.block_size, self.block_table_rows),
            self.device,
            self.kv_caches,
            self.ops.attention_hints,
        )
        if feed is not None:  # the previous step's tokens, still on the device (engine.core.async_steps)
            feed.apply(input_ids)
        if has_images and self.images.bidirectional:
            inputs.image_spans = image_spans(batch.seqs, batch.num_new_tokens, self.block_size, self.device)
        if self.model_config.mrope_section:
            positions = step_positions(batch.seqs, batch.num_new_tokens, self.device)
            if positions is not None and positions.dim() == 1:  # past every prompt: plain RoPE at index + delta
                inputs.positions = positions
            else:
                inputs.mrope_positions = positions
        return input_ids, inputs, sample_rows

    feeds_sampled_tokens = True  # takes async scheduling's `feed` (a tensor-parallel runner does not)

    @torch.no_grad()
    def execute(self, batch: ScheduledBatch, extra_rows: list[int] | None = None, feed=None):
        """Logits [num sampling seqs, vocab] in batch order (seqs mid-prefill have none).

        With `extra_rows` (indices into the batch's flattened new tokens), returns
        (logits, the final hidden states of those rows) from the same forward pass. `feed`
        (engine.core.async_steps.Feed): input rows taken from the step in flight's sampled tokens."""
        if self.step_threads is None:
            return self._execute(batch, extra_rows, feed)
        tokens = sum(batch.num_new_tokens)
        context = 0  # the positions the rows' last tokens see, counted only where the step may be small
        if self.step_threads.may_be_small(tokens):
            context = tokens + sum(s.num_computed_tokens for s in batch.seqs)
        with self.step_threads.step(tokens, context):  # small or on a busy host: one thread
            return self._execute(batch, extra_rows, feed)

    def _execute(self, batch: ScheduledBatch, extra_rows: list[int] | None = None, feed=None):
        image_embeds = self.images.for_batch(batch.seqs, batch.num_new_tokens) if self.images else None
        if extra_rows:
            input_ids, inputs, sample_rows = self.prepare(batch, image_embeds is not None, feed)
            hidden = self.model(input_ids, inputs, image_embeds)
            extra = hidden[to_device(extra_rows, torch.long, self.device)]
            return self.model.compute_logits(hidden.index_select(0, sample_rows)), extra
        if image_embeds is None and self.graph_runner is not None and self.graph_runner.can_run(batch.num_new_tokens):
            hidden = self.graph_runner.run(batch.seqs, feed)
            # A one-token chunk that does not finish its prompt has nothing to sample.
            rows = [i for i, s in enumerate(batch.seqs) if s.num_computed_tokens + 1 == len(s)]
            if len(rows) < len(batch.seqs):
                hidden = hidden.index_select(0, to_device(rows, torch.long, self.device))
            return self.model.compute_logits(hidden)
        input_ids, inputs, sample_rows = self.prepare(batch, image_embeds is not None, feed)
        hidden = self.model(input_ids, inputs, image_embeds)
        return self.model.compute_logits(hidden.index_select(0, sample_rows))


def _matmul_weights(model: torch.nn.Module) -> int:
    """Multiply-adds per token through the model's linear layers (each with in/out features, packed or
    quantized alike), and every routed expert's weights: a step of a few tokens reads most of an MoE
    layer's experts, whose streaming gains from every thread. The measure of a step's size that picks
    its threads (`engine.runner.cpu_threads`)."""
    linear = sum(
        m.in_features * m.out_features
        for m in model.modules()
        if hasattr(m, "in_features") and hasattr(m, "out_features")
    )
    return linear + sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in model.modules() if isinstance(m, Experts))
