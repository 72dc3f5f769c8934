"""The model runner of every tensor-parallel rank. Each builds its share of the model (`sharding`),
loads only its slices, packs them (oneDNN on the CPU), adds the collectives (`layers`) and holds the
KV cache of its own heads. Rank 0 runs the engine (scheduler, sampler): for each step it broadcasts
the step's inputs (a `StepPlan`) on the control group, then every rank runs the same forward; the
logits arrive on rank 0 alone. The other ranks wait in `serve` for rank 0's next message.

A step that fails on any rank leaves the ranks out of step for good, so any failure is fatal:
`TensorParallelError`, and the engine (and the worker around it) ends."""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist

from engine.hf.config import EngineConfig, ModelConfig
from engine.parallel.group import RankGroup, TensorParallelError
from engine.parallel.layers import install
from engine.parallel.sharding import ShardReader, local_config
from engine.runner.model_runner import ModelRunner
from engine.runner.step_plan import plan_step, step_tensors

log = logging.getLogger(__name__)


class TensorParallelRunner(ModelRunner):
    feeds_sampled_tokens = False  # the other ranks build their inputs from rank 0's broadcast plan: synchronous

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        group: RankGroup,
    ):
        self.group = group
        self.full_config = model_config
        self.failure: str | None = None  # set once the group is broken
        self.on_close = None  # rank 0: stops the ranks it started (engine.parallel.launch)
        self.dead_ranks = lambda: []  # rank 0: which of the ranks it started have exited, in words
        super().__init__(config, local_config(model_config, group.world_size), device, dtype)
        install(self.model, group.rank, group.world_size, model_config.vocab_size)

    def _load_weights(self, model) -> bool:
        model.read_checkpoint_tensor = ShardReader(self.full_config, self.group.rank, self.group.world_size)
        try:
            return super()._load_weights(model)
        finally:
            del model.read_checkpoint_tensor

    def _make_graph_runner(self):
        return None  # CUDA graphs are not captured around the collectives (yet): every step runs eagerly

    def _auto_num_blocks(self) -> int:
        """The same pool on every rank: the smallest any rank has room for."""
        count = torch.tensor([super()._auto_num_blocks()], dtype=torch.long, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        return int(count.item())

    def check_params(self, params) -> None:
        """Refuse what a tensor-parallel engine cannot serve (called by LLMEngine.check_request)."""
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported with tensor_parallel_size > 1")
        if params.extra_args and "kv_transfer_params" in params.extra_args:
            raise ValueError(
                "prefill/decode disaggregation (kv_transfer_params) is not supported with tensor_parallel_size > 1"
            )

    # ---- rank 0 -------------------------------------------------------------------

    def execute(self, batch, extra_rows: list[int] | None = None):
        def step():
            plan = plan_step(batch, self.block_size)
            self._send(("step", plan, extra_rows))
            return self._run(plan, extra_rows)

        return self._guarded(step)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self._guarded(lambda: (self._send(("copy", pairs)), super(TensorParallelRunner, self).copy_blocks(pairs)))

    def weight_bytes_per_rank(self) -> list[int]:
        """Each rank's resident weight bytes (`weight_bytes`), gathered on rank 0."""
        return self._guarded(lambda: (self._send(("weights",)), self._gather_weight_bytes())[1])

    def _gather_weight_bytes(self) -> list[int] | None:
        out = [None] * self.group.world_size if self.group.is_driver else None
        dist.gather_object(weight_bytes(self.model), out, dst=0, group=self.group.control)
        return out

    def rank_failed(self, why: str) -> None:
        """The watchdog's report of a dead rank: every later step raises."""
        if self.failure is None:
            self.failure = why
            log.error("tensor parallelism: %s; this engine cannot go on", why)

    def close(self) -> None:
        """Stop the other ranks (rank 0); safe to call more than once."""
        if self.failure is None:
            with contextlib.suppress(Exception):  # the ranks may be gone already
                self._send(("stop",))
            self.failure = "the engine was closed"
        if self.on_close is not None:
            self.on_close()

    def _guarded(self, work):
        if self.failure is not None:
            raise TensorParallelError(f"tensor-parallel group is broken: {self.failure}")
        try:
            return work()
        except Exception as exc:
            why = "; ".join(self.dead_ranks()) or f"a step failed on rank 0 or in a collective ({exc})"
            self.rank_failed(why)
            raise TensorParallelError(f"tensor-parallel step failed: {why}") from exc

    def _send(self, message: tuple) -> None:
        dist.broadcast_object_list([message], src=0, group=self.group.control)

    @torch.no_grad()
    def _run(self, plan, extra_rows):
        input_ids, inputs, sample_rows = step_tensors(plan, self.device, self.kv_caches, self.ops.attention_hints)
        hidden = self.model(input_ids, inputs)
        logits = self.model.compute_logits(hidden[sample_rows])
        if extra_rows:
            return logits, hidden[torch.tensor(extra_rows, dtype=torch.long, device=self.device)]
        return logits

    # ---- ranks 1..N-1 -------------------------------------------------------------------

    def serve(self) -> None:
        """Run rank 0's steps until it says stop (returns) or fails (raises)."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.group.control)
            message = box[0]
            if message[0] == "stop":
                return
            if message[0] == "step":
                self._run(message[1], message[2])
            elif message[0] == "weights":
                self._gather_weight_bytes()
            elif message[0] == "copy":
                super().copy_blocks(message[1])
            else:
                raise TensorParallelError(f"unknown message from rank 0: {message[0]!r}")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights `model` holds (parameters and packed weights, each storage once; not the
    rotary tables, which every rank holds whole)."""
    tensors = [t for _, t in model.named_parameters()]
    tensors += [t for name, t in model.named_buffers() if not name.startswith("cos_sin")]
    storages = {}
    for t in tensors:
        if t.is_mkldnn:  # oneDNN's packed weight: an opaque tensor of its logical size
            storages[id(t)] = t.numel() * t.element_size()
        else:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())
