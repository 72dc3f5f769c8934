"""Adapters loaded on demand into a bounded set of slots, as vLLM does: up to `max_cpu_loras` read
adapters kept in memory (LRU; one evicted is read again from its directory when next needed), and
`max_loras` device slots in the model's stacked LoRA weights (LRU among the adapters the step does not
use). The scheduler never puts more than `max_loras` adapters in one step, so a step's adapters always
fit. Slot 0 is the base model (zeros)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import torch
from torch import nn

from engine.lora.layers import StepMapping, wrap_linears
from engine.lora.peft_adapter import LoRAAdapter, load_peft_adapter
from engine.lora.request import LoRARequest

log = logging.getLogger(__name__)

# A CPU step multiplies each run of rows under one adapter on its own when there is one run per adapter
# (the scheduler's grouping) or the runs average this many rows (prefill chunks); else the masked path.
RUN_ROWS = 16


class LoRASlots:
    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.device, self.dtype = device, dtype
        self.layers, self._step = wrap_linears(model, max_loras, max_lora_rank, dtype, device)
        self.requests: dict[int, LoRARequest] = {}  # every adapter ever registered, by id
        self.in_memory: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU, oldest first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> device slot, LRU
        self.loads = 0  # adapters copied into a slot (swaps included)
        self._lock = threading.Lock()  # requests are registered from any thread, slots filled by the stepper

    def register(self, request: LoRARequest) -> int:
        """Check (reading it if new) the adapter a request asks for; returns its id. ValueError if it
        cannot be served, or if its id already names another adapter."""
        known = self.requests.get(request.lora_int_id)
        if known is None:
            adapter = self._read(request)  # outside the lock: reading a large adapter takes a while
            with self._lock:
                known = self.requests.setdefault(request.lora_int_id, request)
                if known is request:
                    self._keep(adapter)
        if (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
            raise ValueError(
                f"lora_int_id {request.lora_int_id} already names adapter {known.lora_name!r} "
                f"({known.lora_path}); one id is one adapter"
            )
        return request.lora_int_id

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        adapter = load_peft_adapter(request.lora_path, request.lora_name, request.lora_int_id, self.max_lora_rank)
        whole = {(layer, m) for layer, m in adapter.weights if m in ("qkv_proj", "gate_up_proj")}
        for layer, module in adapter.weights:
            where = self.layers.get((layer, module))
            if where is None:
                raise ValueError(
                    f"LoRA adapter {request.lora_name!r} targets layer {layer} {module}, which this "
                    "model has no linear layer for"
                )
            a, b = adapter.weights[(layer, module)]
            problem = where.check(module, a, b)
            if problem:
                raise ValueError(f"LoRA adapter {request.lora_name!r} does not fit the model: layer {layer}: {problem}")
            fused = "qkv_proj" if module in ("q_proj", "k_proj", "v_proj") else "gate_up_proj"
            if module not in ("o_proj", "down_proj", "qkv_proj", "gate_up_proj") and (layer, fused) in whole:
                raise ValueError(
                    f"LoRA adapter {request.lora_name!r} targets both {fused} and {module} of layer {layer}"
                )
        return adapter

    def _keep(self, adapter: LoRAAdapter) -> None:
        self.in_memory[adapter.int_id] = adapter
        self.in_memory.move_to_end(adapter.int_id)
        while len(self.in_memory) > self.max_cpu_loras:
            evicted, _ = self.in_memory.popitem(last=False)
            log.debug("LoRA adapter %d dropped from memory", evicted)

    def _adapter(self, int_id: int) -> LoRAAdapter:
        with self._lock:
            adapter = self.in_memory.get(int_id)
            request = self.requests[int_id]
        if adapter is None:
            adapter = self._read(request)
        with self._lock:
            self._keep(adapter)
        return adapter

    def activate(self, ids: set[int]) -> None:
        """Give each adapter of `ids` (at most max_loras) a device slot, evicting the least recently used
        adapters that `ids` does not hold."""
        if len(ids) > self.max_loras:
            raise RuntimeError(f"{len(ids)} adapters in one step, max_loras={self.max_loras}")
        for int_id in ids:
            if int_id in self.slot_of:
                self.slot_of.move_to_end(int_id)
        for int_id in sorted(ids - self.slot_of.keys()):
            taken = set(self.slot_of.values())
            free = [s for s in range(1, self.max_loras + 1) if s not in taken]
            if free:
                slot = free[0]
            else:
                victim = next(i for i in self.slot_of if i not in ids)
                slot = self.slot_of.pop(victim)
            adapter = self._adapter(int_id)
            by_layer: dict[int, dict] = {}
            for (layer, module), pair in adapter.weights.items():
                by_layer.setdefault(id(self.layers[(layer, module)]), {})[module] = pair
            for layer in {id(m): m for m in self.layers.values()}.values():
                parts = by_layer.get(id(layer), {})
                if parts or layer.used[slot]:
                    layer.set_slot(slot, parts)
            self.slot_of[int_id] = slot
            self.loads += 1

    def begin_step(self, lora_ids: list[int], num_new_tokens: list[int]) -> None:
        """Map the step's rows (sequence by sequence, `num_new_tokens` rows each) to their adapters' slots."""
        used = {i for i in lora_ids if i}
        if not used:
            self._step[0] = StepMapping()
            return
        self.activate(used)
        slots = [self.slot_of[i] if i else 0 for i in lora_ids]
        active = tuple(sorted(set(slots) - {0}))
        if self.device.type != "cuda":
            runs = adapter_runs(slots, num_new_tokens)
            if len(runs) <= len(active) or sum(num_new_tokens) >= RUN_ROWS * len(runs):
                self._step[0] = StepMapping(active, runs=runs)
                return
        per_row = torch.repeat_interleave(torch.tensor(slots), torch.tensor(num_new_tokens))
        if self.device.type == "cuda":
            self._step[0] = StepMapping(active, slots=per_row.to(self.device, torch.int32, non_blocking=True))
        else:
            onehot = torch.nn.functional.one_hot(per_row, max(active) + 1)[:, 1:].to(self.dtype)
            self._step[0] = StepMapping(active, onehot=onehot)

    def end_step(self) -> None:
        self._step[0] = StepMapping()


def adapter_runs(slots: list[int], counts: list[int]) -> tuple[tuple[int, int, int], ...]:
    """(slot, first row, end row) of each run of consecutive rows under one adapter (`counts` rows of
    each sequence in turn under `slots`); the base model's rows are in none."""
    runs, first = [], 0
    for slot, n in zip(slots, counts):
        if slot and runs and runs[-1][0] == slot and runs[-1][2] == first:
            runs[-1][2] += n
        elif slot and n:
            runs.append([slot, first, first + n])
        first += n
    return tuple(tuple(run) for run in runs)


def register_lora(runner, lora_request: LoRARequest | None, prompt=None) -> int:
    """The adapter id of `lora_request` (read and checked if new; any thread), 0 for None; ValueError if
    it cannot be served. A prompt dict may carry it as "lora_request" (callers that pass prompts through,
    as the workers' engine host)."""
    if lora_request is None and isinstance(prompt, dict):
        lora_request = prompt.get("lora_request")
    if lora_request is None:
        return 0
    slots = getattr(runner, "lora", None)
    if slots is None:
        raise ValueError("a lora_request needs LLM(..., enable_lora=True)")
    if not isinstance(lora_request, LoRARequest):
        raise ValueError(f"lora_request must be an engine.lora.request.LoRARequest, got {type(lora_request).__name__}")
    return slots.register(lora_request)


def lora_per_prompt(engine, lora_request, count: int) -> list[LoRARequest | None]:
    """`LLM.generate`'s lora_request (None, one for every prompt, or a list of one per prompt) as one per
    prompt, every adapter read and checked before any request is added."""
    if not isinstance(lora_request, (list, tuple)):  # None or one request for every prompt
        loras = [lora_request] * count
    else:
        loras = list(lora_request)
        if len(loras) != count:
            raise ValueError(f"The lengths of prompts ({count}) and lora_request ({len(loras)}) must be the same.")
    for lora in {id(x): x for x in loras if x is not None}.values():
        register_lora(engine.runner, lora)
    return loras
