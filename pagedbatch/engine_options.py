"""The engine's command-line options, in one list: `run`, `worker` and `serve` take them, and `serve`
hands every one of them to the workers it starts.

Each option is a field of `engine.EngineConfig` of the same name; adding one here is all it takes.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "float16", "float", "half")


def device_name(text: str) -> str:
    """auto, cpu, cuda or cuda:N."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; expected auto, cpu, cuda or cuda:N")
    return text


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def on_off(text: str) -> bool:
    """on or off (true/false, yes/no, 1/0)."""
    value = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}
    if text.lower() not in value:
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return value[text.lower()]


@dataclass(frozen=True)
class EngineOption:
    name: str  # the EngineConfig field, and the keyword argument of engine.LLM / LLMEngine
    type: Callable[[str], object]  # parses and checks the value (argparse's type)
    default: object  # None: the engine decides
    help: str
    choices: tuple | None = None
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


ENGINE_OPTIONS = (
    EngineOption("device", device_name, "auto", "cuda, cuda:N or cpu; auto: cuda when there is one"),
    EngineOption("dtype", str, "auto", "auto: float32 on CPU, the checkpoint's 16-bit type on a GPU", DTYPES),
    EngineOption("max_num_seqs", positive_int, 256, "most sequences in one engine step"),
    EngineOption(
        "tensor_parallel_size",
        positive_int,
        1,
        "split the model across this many ranks, one process (GPU) each; see docs/tensor_parallel.md",
    ),
    EngineOption("num_kv_blocks", positive_int, None, "KV cache blocks; default: as many as the memory budget allows"),
    EngineOption(
        "quantization",
        str,
        None,
        "the checkpoint's quantization method (compressed-tensors, fp8, awq, "
        "gptq); fp8 also quantizes an unquantized checkpoint at load; default: its quantization_config",
    ),
    EngineOption(
        "async_scheduling",
        on_off,
        None,
        "schedule the next step while the device runs this one (default: on with CUDA, off on the CPU)",
        (True, False),
        "on|off",
    ),
    EngineOption("max_loras", positive_int, None, "LoRA adapters in one step (default: the --lora count, up to 8)"),
    EngineOption("max_lora_rank", positive_int, None, "largest LoRA rank (default: the --lora adapters' largest)"),
    EngineOption("max_cpu_loras", positive_int, None, "LoRA adapters kept in memory (default: max_loras)"),
)
LORA_OPTIONS = ("max_loras", "max_lora_rank", "max_cpu_loras")


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    for option in ENGINE_OPTIONS:
        parser.add_argument(
            option.flag,
            type=option.type,
            default=option.default,
            choices=option.choices,
            metavar=option.metavar,
            help=option.help,
        )
    parser.add_argument(
        "--lora",
        action="append",
        metavar="NAME=DIR",
        help="a PEFT LoRA adapter served over the model; batch lines name it as their model",
    )


def lora_modules(args: argparse.Namespace) -> dict[str, str]:
    """The --lora adapters, {name: directory}; ValueError naming a bad one."""
    from engine.lora.adapter_dirs import parse_lora_modules

    return parse_lora_modules(getattr(args, "lora", None))


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments for the engine: every option that has a value (LoRA's only with --lora)."""
    from engine.lora.adapter_dirs import lora_engine_kwargs

    values = {option.name: getattr(args, option.name) for option in ENGINE_OPTIONS}
    kwargs = {name: value for name, value in values.items() if value is not None}
    return kwargs | lora_engine_kwargs(lora_modules(args), {name: values[name] for name in LORA_OPTIONS})


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The same options as command-line arguments, for a child process that parses them again."""
    values = ((option.flag, getattr(args, option.name)) for option in ENGINE_OPTIONS)
    loras = [f"--lora={item}" for item in getattr(args, "lora", None) or ()]
    return [f"{flag}={_argument(value)}" for flag, value in values if value is not None] + loras


def _argument(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)
