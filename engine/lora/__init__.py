"""Multi-LoRA serving: many PEFT adapters over one base model in one batch (vLLM's `enable_lora`).

`request` (vLLM's `LoRARequest`, torch-free), `peft_adapter` (reading a PEFT adapter directory),
`slots` (adapters loaded on demand: an LRU of `max_cpu_loras` in memory, `max_loras` device slots of
stacked weights), `layers` (the model's linear layers with the batched adapter delta added to their
output). The delta kernels are in `pagedbatch_kernels.lora_quant.lora` (Triton) and `lora_reference` (torch).
"""

from engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
