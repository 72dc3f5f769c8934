"""The command line's `--lora NAME=DIR` adapters, torch-free: parsed and checked, and the engine options
they need (`enable_lora`; unless given, `max_loras` and `max_lora_rank` large enough for all of them)."""

from __future__ import annotations

import json
from pathlib import Path

MAX_DEFAULT_SLOTS = 8


def parse_lora_modules(items: list[str] | None) -> dict[str, str]:
    """{name: absolute directory} from NAME=DIR items; ValueError naming a bad one."""
    modules: dict[str, str] = {}
    for item in items or ():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora {item!r}: expected NAME=DIR")
        if name in modules:
            raise ValueError(f"--lora {name}: given twice")
        if not (Path(path) / "adapter_config.json").is_file():
            raise ValueError(f"--lora {name}: {path} is not a PEFT adapter directory (no adapter_config.json)")
        modules[name] = str(Path(path).resolve())
    return modules


def adapter_rank(path: str) -> int:
    """The largest rank an adapter's adapter_config.json names (r, and rank_pattern's)."""
    config = json.loads((Path(path) / "adapter_config.json").read_text())
    return max([int(config.get("r", 8)), *map(int, (config.get("rank_pattern") or {}).values())])


def lora_engine_kwargs(modules: dict[str, str], given: dict) -> dict:
    """The engine options serving `modules` (none when there are none), `given` ones kept."""
    if not modules:
        return {}
    options = {
        "enable_lora": True,
        "max_loras": min(len(modules), MAX_DEFAULT_SLOTS),
        "max_lora_rank": max(adapter_rank(p) for p in modules.values()),
    }
    options.update({k: v for k, v in given.items() if v is not None})
    return options
