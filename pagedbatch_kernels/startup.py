"""How the CPU kernels start: `full` (compile every kernel with inductor, time the attention variants, build the
native library before the first step: what a long-running engine wants) or `quick` (none of it before the
first step: kernels run eagerly, the attention variants are the usual winners without timing, the native
library is used if this machine already built it, else built in a detached process for the next start while
this one runs torch's kernels). A job of a few requests finishes sooner eagerly than the compiling costs.
`deferred` (a worker's default) starts quick and turns full the first time the engine is idle long enough
(`workers.host.engine_host`): the worker takes shards at once and compiles between them.

`PAGEDBATCH_STARTUP=quick|full` sets it for a process; `use(...)` sets it from code (`pagedbatch run` picks
quick for small files)."""

from __future__ import annotations

from settings import EngineSettings, export, value

ENV = "PAGEDBATCH_STARTUP"
MODES = ("full", "quick", "deferred")


def mode() -> str:
    return value(EngineSettings, "startup")


def quick() -> bool:
    """Whether kernels run eagerly and untimed now (a quick start, or a deferred one not finished yet)."""
    return mode() != "full"


def deferred() -> bool:
    return mode() == "deferred"


def use(value: str) -> None:
    """Set the mode for this process and the processes it starts."""
    if value not in MODES:
        raise ValueError(f"startup mode {value!r}: expected one of {', '.join(MODES)}")
    export(ENV, value)
