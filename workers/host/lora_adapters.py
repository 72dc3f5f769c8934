"""The LoRA adapters this worker process serves over its model (`--lora NAME=DIR`): a batch line whose
model names one runs on the base model with that adapter (`line_requests.engine_request`)."""

from __future__ import annotations

from engine.lora.request import LoRARequest

_adapters: dict[str, LoRARequest] = {}


def configure(modules: dict[str, str]) -> None:
    """Serve these adapters ({name: directory}); each gets a stable id (its place in name order)."""
    _adapters.clear()
    for int_id, name in enumerate(sorted(modules), 1):
        _adapters[name] = LoRARequest(name, int_id, modules[name])


def request_for(model: str | None) -> LoRARequest | None:
    return _adapters.get(model) if model else None
