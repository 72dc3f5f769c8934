"""The engine's command-line options, in one list: `run`, `worker` and `serve` take them, and `serve`
hands every one of them to the workers it starts.

Each option is a field of `engine.EngineConfig` of the same name; adding one here is all it takes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineOption:
    name: str  # the EngineConfig field, and the keyword argument of engine.LLM / LLMEngine
    type: type
    default: object  # None: the engine decides
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


ENGINE_OPTIONS = (
    EngineOption("device", str, "auto", "cuda, cuda:N or cpu; auto: cuda when there is one"),
    EngineOption("dtype", str, "auto", "auto, float32, bfloat16 or float16"),
    EngineOption("max_num_seqs", int, 256, "most sequences in one engine step"),
    EngineOption("num_kv_blocks", int, None, "KV cache blocks; default: as many as the memory budget allows"),
)


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    for option in ENGINE_OPTIONS:
        parser.add_argument(option.flag, type=option.type, default=option.default, help=option.help)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments for the engine: every option that has a value."""
    values = {option.name: getattr(args, option.name) for option in ENGINE_OPTIONS}
    return {name: value for name, value in values.items() if value is not None}


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The same options as command-line arguments, for a child process that parses them again."""
    values = ((option.flag, getattr(args, option.name)) for option in ENGINE_OPTIONS)
    return [f"{flag}={value}" for flag, value in values if value is not None]
