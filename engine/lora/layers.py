"""The model's linear layers with the batched LoRA delta added to the base layer's output (whatever
computes it: `nn.Linear`, or `engine.cpu_linear.PackedLinear`'s oneDNN-packed weight on the CPU).

Each wrapped layer holds its adapters' weights stacked by slot, ranks padded to `max_lora_rank`, slot 0
all zeros: A [slots + 1, parts * R, in] and B transposed, [slots + 1, parts * R, out], where a fused
layer's parts (q/k/v of `qkv_proj`, gate/up of `gate_up_proj`) each own R rows of A and their columns of
B, so that one pair of matmuls covers every part.

On the CPU, where the scheduler groups a step's sequences by adapter, each adapter's rows form a run
(`StepMapping.runs`), multiplied by that slot's A and B alone: two matmuls per run on row slices, no
work for the base model's rows. A step whose rows interleave adapters in short runs (not the
scheduler's) takes the masked path instead: every row through the stacked A of all slots in use at once
(one matmul), each row's own slot's ranks kept by a one-hot mask (built once per step), the product with
the stacked B added to the output: three calls whatever the mix, for (slots in use) x the work. On the
2-core AMD EPYC at one thread, a 5120-row prefill's four projections took 435 ms by runs, 615 masked
and 432 without LoRA (4 adapters of rank 16 and the base, a fifth each); a 40-row decode step 2.9, 3.7
and 2.4 ms. On CUDA the Triton kernel (`pagedbatch_kernels.lora_quant.lora`) reads each row's own
slot only."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

# our fused layer -> the checkpoint modules that are its parts (in output order); the fused name itself
# (Phi-3's checkpoints, and adapters trained on them, hold qkv_proj/gate_up_proj whole) covers every row.
FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "o_proj": ("o_proj",),
    "down_proj": ("down_proj",),
}
BLOCKS = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}


@dataclass
class StepMapping:
    """The step's rows' slots: `active` (the slots in use, not 0), and on the CPU either `runs` ((slot,
    first row, end row) of each run of rows under one adapter) or `onehot` [T, top] (row t has a 1 in
    column slot - 1, none for the base model; `top` = the highest slot in use); on CUDA `slots` [T].
    Empty: no adapter row."""

    active: tuple[int, ...] = ()
    runs: tuple[tuple[int, int, int], ...] | None = None
    onehot: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.active)

    def mask(self, width: int) -> torch.Tensor:
        """[T, top * width]: 1 on the `width` ranks of each row's own slot."""
        if width not in self._masks:
            self._masks[width] = self.onehot.repeat_interleave(width, dim=1)
        return self._masks[width]


class LoRALinear(nn.Module):
    def __init__(
        self,
        base: nn.Module,
        part_sizes: dict[str, tuple[int, int, int]],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        step: list,
    ):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.parts = part_sizes  # checkpoint module -> (part index, first output row, rows)
        self.max_rank = max_rank
        width = max(index for index, _, _ in part_sizes.values()) + 1
        shape = (num_slots + 1, width * max_rank)
        self.register_buffer(
            "lora_a", torch.zeros(*shape, self.in_features, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "lora_bt", torch.zeros(*shape, self.out_features, dtype=dtype, device=device), persistent=False
        )
        self.used = [False] * (num_slots + 1)  # slots whose adapter has weights here
        self.step = step  # one-item list shared by every layer: the step's StepMapping

    @property
    def lora_b(self) -> torch.Tensor:
        """B as [slots + 1, out, parts * R] (a view)."""
        return self.lora_bt.transpose(1, 2)

    def check(self, module: str, a: torch.Tensor, b: torch.Tensor) -> str | None:
        """Why (a, b) cannot go on part `module`, or None."""
        if module not in self.parts:
            return f"this model has no {module} layer"
        _, _, rows = self.parts[module]
        if a.shape[1] != self.in_features or b.shape[0] != rows:
            return (
                f"{module} is [{rows}, {self.in_features}] in the model, but the adapter's delta is "
                f"[{b.shape[0]}, {a.shape[1]}]"
            )
        return None

    @torch.no_grad()
    def set_slot(self, slot: int, parts: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.lora_a[slot].zero_()
        self.lora_bt[slot].zero_()
        for module, (a, b) in parts.items():
            index, first, rows = self.parts[module]
            r0, r = index * self.max_rank, a.shape[0]
            self.lora_a[slot, r0 : r0 + r].copy_(a)
            self.lora_bt[slot, r0 : r0 + r, first : first + rows].copy_(b.T)
        self.used[slot] = bool(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.step[0]
        if not step or not any(self.used[s] for s in step.active):
            return y
        x2, y2 = x.reshape(-1, self.in_features), y.view(-1, self.out_features)
        if step.slots is not None:
            from pagedbatch_kernels.lora_quant.lora import add_lora_delta

            add_lora_delta(y2, x2, self.lora_a, self.lora_b, step.slots)
            return y
        if step.runs is not None:
            for slot, first, end in step.runs:
                if self.used[slot]:
                    y2[first:end].addmm_(x2[first:end] @ self.lora_a[slot].T, self.lora_bt[slot])
            return y
        top, width = step.onehot.shape[1], self.lora_a.shape[1]  # slots 1..top (slot 0 adds nothing)
        shrunk = (x2 @ self.lora_a[1 : top + 1].view(top * width, self.in_features).T).mul_(step.mask(width))
        y2.addmm_(shrunk, self.lora_bt[1 : top + 1].view(top * width, self.out_features))
        return y


def wrap_linears(
    model: nn.Module, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device
) -> tuple[dict[tuple[int, str], LoRALinear], list]:
    """Wrap every decoder layer's linear projections; returns ({(layer, checkpoint module): its
    LoRALinear}, the shared one-item list holding the step's mapping)."""
    step = [StepMapping()]
    found: dict[tuple[int, str], LoRALinear] = {}
    for index, layer in enumerate(model.model.layers):
        for fused, block_name in BLOCKS.items():
            block = getattr(layer, block_name, None)
            base = getattr(block, fused, None)
            if not isinstance(base, nn.Module) or not hasattr(base, "in_features"):
                continue  # e.g. the experts of a mixture-of-experts block: parameters, not layers
            parts = _part_sizes(model, fused, base.out_features)
            wrapped = LoRALinear(base, parts, num_slots, max_rank, dtype, device, step)
            setattr(block, fused, wrapped)
            for module in parts:
                found[(index, module)] = wrapped
    return found, step


def _part_sizes(model: nn.Module, fused: str, out_features: int) -> dict[str, tuple[int, int, int]]:
    names = FUSED_PARTS[fused]
    sizes = model.shard_sizes(fused) if len(names) > 1 else [out_features]
    parts, first = {}, 0
    for index, (name, rows) in enumerate(zip(names, sizes)):
        parts[name] = (index, first, rows)
        first += rows
    if len(names) > 1:
        parts[fused] = (0, 0, out_features)  # the whole fused layer; shares part 0's rank rows
    return parts
