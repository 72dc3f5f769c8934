"""Plain-torch kernels compiled by inductor for the CPU engine: each is compiled on first use with
the sizes that vary from step to step (tokens, sequences, blocks) as symbols and the others (hidden
size, heads, head size, block size) as constants, once per process, dtype and rank (inductor caches
the generated code on disk across processes); it falls back to running eagerly, with a warning,
where compilation fails (no C++ compiler, say). The eager function is the contract: compiled, it
fuses the loops and skips the per-op overhead, which on a small model's step costs more than the
arithmetic. Constant sizes matter: the loops over a head or a block are then unrolled and
vectorised whole (the decode kernel ran 1.5-2x faster than with every size symbolic)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading

import torch

from pagedbatch_kernels import reference, startup
from pagedbatch_kernels.cpu import cpu_pointwise
from settings import EngineSettings, export, value

log = logging.getLogger(__name__)
RECOMPILE_LIMIT = 64  # dtypes x ranks x head shapes, across the models one process may load
_setup_lock = threading.Lock()


def _configure_dynamo() -> None:
    # inductor's compiled code is kept with the project's other caches (not /tmp, which a reboot empties),
    # one directory per torch version; inductor's own keys cover the graph, its source and the options
    if not value(EngineSettings, "torchinductor_cache_dir"):
        base = value(EngineSettings, "xdg_cache_home") or os.path.join(os.path.expanduser("~"), ".cache")
        export("TORCHINDUCTOR_CACHE_DIR", os.path.join(base, "pagedbatch", f"inductor-{torch.__version__}"))
    with _setup_lock:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        # Sizes that happen to be equal in the first call (a batch of two, two KV heads) must not
        # be assumed equal for good: that would compile again at the next size.
        torch.fx.experimental._config.use_duck_shape = False


class Compiled:
    """`fn`, compiled on first call; `fallback` (`fn` itself by default) from then on if compiling
    it failed. `varying` maps an argument's position to its dimensions that vary between calls
    (the first argument's first dimension by default); every other size is compiled in as a
    constant, and a call that changes one compiles again (dynamo then makes it symbolic too).
    Calls whose first argument has fewer than `eager_below` elements run `small` (`fn` eagerly by
    default): a compiled call costs ~25-70 us of dynamo's bookkeeping, more than a decode step's few
    rows are worth. `eager_below` may map dtypes to their own bounds (None: any other dtype's); an
    infinite one means `small` always, never compiled, not even by `compiling_everything`."""

    force = False  # set by `compiling_everything`

    def __init__(
        self,
        fn,
        fallback=None,
        eager_below: float | dict[torch.dtype | None, float] = 0,
        varying: dict[int, tuple[int, ...]] | None = None,
        small=None,
    ):
        self.fn = fn
        self.fallback = fallback or fn
        self.eager_below = eager_below
        self.small = small or fn
        self.varying = {0: (0,)} if varying is None else varying
        self.compiled = None
        self.failed = False

    def _eager_below(self, dtype: torch.dtype) -> float:
        if isinstance(self.eager_below, dict):
            return self.eager_below.get(dtype, self.eager_below.get(None, 0))
        return self.eager_below

    def __call__(self, *args):
        if self.failed:
            return self.fallback(*args)
        bound = self._eager_below(args[0].dtype)
        if args[0].numel() < bound and (bound == math.inf or not Compiled.force):
            return self.small(*args)
        if startup.quick() and not Compiled.force:  # a quick start never compiles
            return self.fallback(*args)
        if self.compiled is None:
            _configure_dynamo()
            self.compiled = torch.compile(self.fn, fullgraph=True)
        for position, dims in self.varying.items():
            # "maybe": a size of one may still be compiled apart (as a constant) without an error
            torch._dynamo.maybe_mark_dynamic(args[position], dims)
        try:
            return self.compiled(*args)
        except Exception as exc:  # whatever the compiler raised, the eager kernel works
            log.warning("compiling %s failed, running it eagerly: %s", self.fn.__name__, exc)
            self.failed = True
            return self.fallback(*args)


def first_dims(*positions: int) -> dict[int, tuple[int, ...]]:
    """`varying` for arguments that vary in their first dimension only (tokens or rows)."""
    return {position: (0,) for position in positions}


@contextlib.contextmanager
def compiling_everything():
    """Within it, every call is compiled whatever its size (the engine's warm-up compiles them all)."""
    before, Compiled.force = Compiled.force, True
    try:
        yield
    finally:
        Compiled.force = before


# Below where the native kernels (`cpu_pointwise`) ran faster than inductor's on a 2-core AMD EPYC
# (AVX2): float32 norms, rotary and SiLU at every size (1.2-3x at 256..8192 rows of the vs_vllm model,
# where torch's threads share the rows); rotary at every dtype, so it is not wrapped here at all (`engine.runner.ops`
# names `cpu_pointwise.apply_rotary` itself); bfloat16 norms up to ~170 rows of 384 (past that, the
# native rounding to bfloat16 is slower than inductor's loops); bfloat16 SiLU stays with torch.
NATIVE_ALWAYS = math.inf
rms_norm = Compiled(
    reference.rms_norm, eager_below={torch.float32: NATIVE_ALWAYS, None: 64 * 1024}, small=cpu_pointwise.rms_norm
)
fused_add_rms_norm = Compiled(
    reference.fused_add_rms_norm,
    eager_below={torch.float32: NATIVE_ALWAYS, None: 64 * 1024},
    varying=first_dims(0, 1),
    small=cpu_pointwise.fused_add_rms_norm,
)
silu_and_mul = Compiled(
    reference.silu_and_mul,
    eager_below={torch.float32: NATIVE_ALWAYS, None: 512 * 1024},
    small=cpu_pointwise.silu_and_mul,
)
