"""The CPU engine's native attention kernels (`csrc/`): built with the machine's C++ compiler at first
use, for this CPU (-march=native), cached on disk, called through ctypes.

- `decode_attention` (`cpu_decode.cpp`): one query token per row. Inductor's loops for the same
  attention (`cpu_decode.decode_attention`) spent ~50 cycles per score: a horizontal sum and a
  bounds-checked block lookup per element. The native kernel takes a row's query heads together per
  KV head, so each key and value is loaded once for the group.
- `span_attention` (`cpu_spans.cpp`): many rows over one block table each (a prompt chunk's tokens,
  decodes sharing a prefix), as small register-tiled matrix products with an online softmax; for
  bfloat16 pools through AVX-512 BF16 dot products where the CPU has them
  (`span_rounds_bf16_weights`).
- `merge_partial` (`cpu_decode.cpp`): a shared prefix's attention and the tail's into the whole's, in
  place (torch's merge was ~2 ms of a 256-decode step, mostly dispatch).
- `pb_moe_experts` (`cpu_moe.cpp`, called by `cpu_moe`): a decode step's routed experts in one call.

It runs in torch's own OpenMP thread pool (the library links libgomp by soname, which torch has
already loaded), so it adds no threads of its own. PAGEDBATCH_CPU_NATIVE=off keeps the inductor
kernel; so does a machine without a compiler, with a warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedbatch_kernels import startup
from settings import EngineSettings, child_environment, value

log = logging.getLogger(__name__)
ENV = "PAGEDBATCH_CPU_NATIVE"
SOURCES = [
    Path(__file__).parent.parent / "csrc" / name
    for name in ("cpu_decode.cpp", "cpu_spans.cpp", "cpu_pointwise.cpp", "cpu_moe.cpp")
]
HEADERS = [Path(__file__).parent.parent / "csrc" / "cpu_vec.h"]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno"]
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_loaded = False


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))}))
    except OSError:
        return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    base = value(EngineSettings, "xdg_cache_home") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedbatch" / "native"


def _compiler() -> str | None:
    return value(EngineSettings, "cxx") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def compiler() -> str | None:
    """The C++ compiler the kernels are built with; None where there is none."""
    return _compiler()


def library_path(flags: list[str] | None = None) -> Path:
    """Where the shared library for this source, compiler, flags and CPU is cached (built or not)."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++; or set CXX)")
    flags = FLAGS if flags is None else flags
    source = b"\0".join(path.read_bytes() for path in HEADERS + SOURCES)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_signature().encode()])
    ).hexdigest()[:20]
    return _cache_dir() / f"cpu_attention-{key}.so"


def build(flags: list[str] | None = None) -> Path:
    """The shared library for this source, compiler, flags and CPU; compiled unless cached. Raises
    (RuntimeError, OSError) where it cannot be built."""
    compiler = _compiler()
    flags = FLAGS if flags is None else flags
    target = library_path(flags)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # built beside the target and renamed into place: processes building at once each get a whole file
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", partial], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {[path.name for path in SOURCES]}:\n{done.stderr[-2000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def bind(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.pb_supports_head_dim.argtypes = [ctypes.c_int]
    lib.pb_supports_head_dim.restype = ctypes.c_int
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.pb_decode_attention.argtypes = [p, p, p, i, i, p, i, p, p, i, i, i, i, i, ctypes.c_float, ctypes.c_float, p, p]
    lib.pb_decode_attention.restype = ctypes.c_int
    lib.pb_span_attention.argtypes = [p, p, p, i, i, p, i, p, i, p, p, i, i, i, i, i, ctypes.c_float, ctypes.c_float]
    lib.pb_span_attention.argtypes += [p, p]
    lib.pb_span_attention.restype = ctypes.c_int
    lib.pb_span_bf16_weights.argtypes = []
    lib.pb_span_bf16_weights.restype = ctypes.c_int
    f, i64 = ctypes.c_float, ctypes.c_int64
    lib.pb_rms_norm.argtypes = [p, p, p, p, p, i, i, f, i]
    lib.pb_rms_norm.restype = None
    lib.pb_rotary.argtypes = [p, i64, p, p, i64, i, i, i, p, i]
    lib.pb_rotary.restype = ctypes.c_int
    lib.pb_merge_partial.argtypes = [p, p, p, p, i64, i]
    lib.pb_merge_partial.restype = None
    lib.pb_silu_and_mul.argtypes = [p, i, i, p]
    lib.pb_silu_and_mul.restype = None
    lib.pb_write_kv.argtypes = [p, i64, p, i64, p, p, p, i, i64, i, i]
    lib.pb_write_kv.restype = ctypes.c_int
    lib.pb_dequant_fp8.argtypes = [p, p, p, i64, i64, i64, i]
    lib.pb_dequant_fp8.restype = None
    lib.pb_moe_experts.argtypes = [p, i, i, p, p, i, i, p, p, i, p, i]
    lib.pb_moe_experts.restype = ctypes.c_int
    lib.pb_moe_tile_outs.argtypes = []
    lib.pb_moe_tile_outs.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel, built on first call; None where it is turned off or cannot be built."""
    global _library, _loaded
    if _loaded:
        return _library
    with _lock:
        if not _loaded:
            if value(EngineSettings, "cpu_native") != "off":
                try:
                    _library = _built_now_or_later()
                except (RuntimeError, OSError) as exc:
                    log.warning("native CPU attention kernels unavailable, using torch's: %s", exc)
            _loaded = True
    return _library


def _built_now_or_later() -> ctypes.CDLL | None:
    """The library, built now; on a quick start (`startup`) only if this machine has it already, else it is
    built by a detached process for the next start and this one runs torch's kernels."""
    if not startup.quick() or library_path().exists():
        return bind(build())
    build_detached()
    log.info("building the native CPU kernels in the background; torch's kernels meanwhile")
    return None


def build_detached() -> subprocess.Popen:
    """`build()` in a process of its own session: it outlives this one (a short job ends before it). It runs at
    the lowest CPU priority (its compiler too), so that it takes no CPU from the job that started it."""
    code = "import os; os.nice(19); from pagedbatch_kernels.cpu.cpu_native import build; build()"
    return subprocess.Popen(
        [sys.executable, "-c", code],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=child_environment({"PYTHONPATH": _root()}),
    )


def _root() -> str:
    """The directory holding this package, for the builder process to import it from."""
    here = str(Path(__file__).resolve().parent.parent)
    return os.pathsep.join(p for p in (here, value(EngineSettings, "pythonpath")) if p)


def takes(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernels are here and take a pool of this dtype and these heads."""
    lib = library()
    return (
        lib is not None
        and dtype in (torch.float32, torch.bfloat16)
        and num_heads % num_kv_heads == 0
        and bool(lib.pb_supports_head_dim(head_dim))
    )


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernels take this call's tensors: a contiguous CPU pool that `takes`."""
    return (
        k_cache.device.type == "cpu"
        and k_cache.is_contiguous()
        and takes(k_cache.dtype, query.shape[1], k_cache.shape[2], k_cache.shape[3])
    )


def _float32_call(query, k_cache, v_cache):
    """The queries as the kernels read them (float32, contiguous), and the output and log-sum-exp
    tensors they write; the caches checked alike."""
    assert v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype and v_cache.is_contiguous()
    rows, heads, head_dim = query.shape
    return (
        query.to(torch.float32).contiguous(),
        torch.empty((rows, heads, head_dim), dtype=torch.float32),
        torch.empty((rows, heads), dtype=torch.float32),
    )


def _lows(lows, rows: int):
    """A row's first visible positions as the kernels take them: int32, contiguous (None: every row's 0)."""
    if lows is None:
        return None
    lows = lows.to(torch.int32).contiguous()
    assert lows.shape == (rows,)
    return lows


def _cache_args(q, k_cache, v_cache) -> tuple:
    """The native attention kernels' leading arguments: the queries and the paged cache."""
    return q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16), k_cache.shape[0]


def _row_args(lows, rows, query, k_cache, scale, softcap, out, lse) -> tuple:
    """The native attention kernels' trailing arguments: windows, shapes, scaling and the outputs."""
    _, heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    lows_ptr = None if lows is None else lows.data_ptr()
    shapes = (rows, heads, kv_heads, head_dim, block_size)
    return lows_ptr, *shapes, float(scale), float(softcap or 0.0), out.data_ptr(), lse.data_ptr()


def decode_attention(
    query, k_cache, v_cache, block_tables, seq_lens, scale, lib: ctypes.CDLL | None = None, *, lows=None, softcap=None
):
    """`cpu_decode.decode_attention`'s contract (output and log-sum-exp, float32), for tensors that
    `supports` takes, through `lib` (the `library()` by default). A row of length 0 gives zeros and a
    log-sum-exp of -inf. Row r sees its positions from lows[r] (a sliding window's first; `lows` [B]
    int32, None: 0) to seq_lens[r]; with `softcap`, scaled scores s are softcap * tanh(s / softcap)."""
    rows, _, head_dim = query.shape
    q, out, lse = _float32_call(query, k_cache, v_cache)
    tables = block_tables.to(torch.int32).contiguous()
    lengths = seq_lens.to(torch.int32).contiguous()
    assert tables.shape[0] == rows and lengths.shape == (rows,)
    lows = _lows(lows, rows)
    status = (lib or library()).pb_decode_attention(
        *_cache_args(q, k_cache, v_cache),
        tables.data_ptr(),
        tables.shape[1],
        lengths.data_ptr(),
        *_row_args(lows, rows, query, k_cache, scale, softcap, out, lse),
    )
    if status == -1:
        raise ValueError(f"the native decode kernel does not take head size {head_dim}")
    if status != 0:
        raise IndexError("a context runs past its block table or a block past the pool")
    return out, lse


def span_attention(
    query, k_cache, v_cache, tables, bounds, lengths, scale, lib: ctypes.CDLL | None = None, *, lows=None, softcap=None
):
    """Attention of spans of rows of `query` [R, H, D] that each read one block table: span s is rows
    bounds[s][0] to bounds[s][1] (`bounds` [S, 2], spans apart) over `tables[s]` ([S, W]), row r
    seeing the first lengths[r] positions (`lengths` [R]). Returns the output [R, H, D] and the
    log-sum-exp [R, H], float32, for the spans' rows (rows in no span are left unwritten); a row of
    length 0 gives zeros and -inf. For tensors that `supports` takes. `lows` and `softcap` as in
    `decode_attention` (rows before their span's `lows` chunk of positions are not read)."""
    rows, heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    q, out, lse = _float32_call(query, k_cache, v_cache)
    tables = tables.to(torch.int32).contiguous()
    bounds = bounds.to(torch.int32).contiguous()
    lengths = lengths.to(torch.int32).contiguous()
    assert bounds.shape == (tables.shape[0], 2) and lengths.shape == (rows,)
    lows = _lows(lows, rows)
    status = (lib or library()).pb_span_attention(
        *_cache_args(q, k_cache, v_cache),
        tables.data_ptr(),
        tables.shape[1],
        bounds.data_ptr(),
        tables.shape[0],
        lengths.data_ptr(),
        *_row_args(lows, rows, query, k_cache, scale, softcap, out, lse),
    )
    if status == -1:
        raise ValueError(f"the native span kernel does not take head size {head_dim} with {heads}/{kv_heads} heads")
    if status != 0:
        raise IndexError("a span past the rows, a context past its block table or a block past the pool")
    return out, lse


def merge_partial(out_a, lse_a, out_b, lse_b, lib: ctypes.CDLL | None = None):
    """`cpu_decode.merge_partial` (outputs [R, H, D] and log-sum-exps [R, H] of two disjoint parts of
    each context: the whole's), for float32 contiguous CPU tensors, in place into out_a and lse_a,
    which it returns; None where it does not take them (the caller merges with torch)."""
    lib = lib or library()
    tensors = (out_a, lse_a, out_b, lse_b)
    if (
        lib is None
        or any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors)
        or out_b.shape != out_a.shape
        or lse_a.shape != out_a.shape[:-1]
        or lse_b.shape != lse_a.shape
    ):
        return None
    lib.pb_merge_partial(
        out_a.data_ptr(), lse_a.data_ptr(), out_b.data_ptr(), lse_b.data_ptr(), lse_a.numel(), out_a.shape[-1]
    )
    return out_a, lse_a


def span_rounds_bf16_weights(lib: ctypes.CDLL | None = None) -> bool:
    """Whether `span_attention` multiplies bfloat16 pools through AVX-512 BF16 dot products: scores as
    exact as in float32, the softmax weights rounded to bfloat16 before the values (as `transformers`
    computes a bfloat16 model's attention), about 1.5x faster."""
    lib = lib or library()
    return lib is not None and bool(lib.pb_span_bf16_weights())


@dataclass
class Spans:
    """A `span_attention` call planned once per step: spans of consecutive rows from 0 (`bounds`
    [S, 2]), their block tables [S, W] and every row's context length."""

    tables: torch.Tensor
    bounds: torch.Tensor
    lengths: torch.Tensor

    def run(self, query, k_cache, v_cache, scale) -> tuple[torch.Tensor, torch.Tensor]:
        return span_attention(query, k_cache, v_cache, self.tables, self.bounds, self.lengths, scale)


def plan_spans(tables: list[list[int]], sizes: list[int], lengths: list[int], device) -> Spans:
    """Spans of `sizes` consecutive rows each, span s over `tables[s]`, row r seeing lengths[r]."""
    width = max(1, max(len(t) for t in tables))
    ends = [sum(sizes[: s + 1]) for s in range(len(sizes))]
    return Spans(
        tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        bounds=torch.tensor([[end - size, end] for size, end in zip(sizes, ends)], dtype=torch.int32, device=device),
        lengths=torch.tensor(lengths, dtype=torch.int32, device=device),
    )


def dequantize_fp8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """`quant_reference.dequantize` of float8_e4m3fn weights [N, K] with [N, G] scales (G dividing K),
    in the scales' dtype (float32 or bfloat16), in one pass (torch's own fp8 conversion runs element by
    element: ~100x slower); None where the kernels are not here or do not take these tensors."""
    lib = library()
    n, k = qweight.shape
    groups = scales.shape[1]
    if (
        lib is None
        or qweight.device.type != "cpu"
        or scales.dtype not in (torch.float32, torch.bfloat16)
        or k % groups
        or not (qweight.is_contiguous() and scales.is_contiguous())
    ):
        return None
    out = torch.empty((n, k), dtype=scales.dtype)
    lib.pb_dequant_fp8(
        qweight.data_ptr(), scales.data_ptr(), out.data_ptr(), n, k, groups, int(scales.dtype == torch.bfloat16)
    )
    return out
