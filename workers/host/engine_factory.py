"""The engine a worker builds: `--engine-factory module:callable`, or LLMEngine."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable


def load_engine_factory(spec: str | None) -> Callable[..., object]:
    """`module:callable` -> that callable; None -> `engine.LLMEngine`.

    The callable gets LLMEngine's keyword arguments (model=..., device=..., ...) and returns an
    engine: LLMEngine itself, a subclass, or any object that satisfies `engine.core.contract.StepEngine`
    (the host checks it when the engine is built).
    """
    if not spec:
        from engine import LLMEngine

        return LLMEngine
    module, sep, name = spec.partition(":")
    if not (module and sep and name):
        raise ValueError(f"bad engine factory {spec!r}; expected module:callable")
    return functools.reduce(getattr, name.split("."), importlib.import_module(module))
