"""vLLM's `LoRARequest`: which adapter a request runs with. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name`: the adapter's name; `lora_int_id`: its id, unique per adapter and > 0 (vLLM's
    rule: one id is one set of weights); `lora_path`: its PEFT directory (adapter_config.json and
    adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer > 0, got {self.lora_int_id!r}")
        if not self.lora_name or not isinstance(self.lora_name, str):
            raise ValueError("lora_name must be a non-empty string")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} has no lora_path")
        object.__setattr__(self, "lora_path", str(self.lora_path))

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
