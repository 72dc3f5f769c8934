"""Prefill/decode disaggregation inside one engine: export a prompt's KV blocks after its first
token, and import them into another engine that continues as if it had prefilled locally.

A prefill-only request is an ordinary request whose `SamplingParams.extra_args` holds
`{"kv_transfer_params": {"do_remote_decode": True}}` (vLLM's spelling). It runs as usual until
its first token is sampled and checked for stops; if it is not finished then, its prompt's KV
blocks are copied to CPU tensors, its blocks go back to the pool, and the engine hands back a
`RequestOutput` with `finished=False` and `kv_export` set to a `KVBundle`.

`LLMEngine.add_imported_request(request_id, bundle, params)` queues the decode half: at its
step the bundle's blocks are written into this engine's pool (full prompt blocks already in
the prefix cache are shared instead of written), the first token is accepted as if just sampled
(logprobs, detokenizing and stop checks included), and the seeded generator resumes from the
exported state, so greedy and seeded outputs equal a single engine's.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.core.block_manager import cdiv
from engine.core.contract import SequenceEngine
from engine.core.sequence import Sequence, SequenceStatus
from engine.params.outputs import Logprob

_SAMPLE_BYTES = 1 << 20  # of each weight file's start and end, for the fingerprint


def _transfer_params(seq: Sequence) -> dict:
    return (seq.params.extra_args or {}).get("kv_transfer_params") or {}


def wants_export(seq: Sequence) -> bool:
    return bool(seq.params.extra_args and _transfer_params(seq).get("do_remote_decode"))


def model_fingerprint(path: str | Path) -> str:
    """A cheap identity of the weights: config.json, and each safetensors file's name, size, and
    first and last MiB (header and data). Two engines may exchange KV only if these agree."""
    path = Path(path)
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(_SAMPLE_BYTES))
            fh.seek(max(0, size - _SAMPLE_BYTES))
            h.update(fh.read(_SAMPLE_BYTES))
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class KVMeta:
    """What must agree between the two engines for the blocks to mean the same thing."""

    block_size: int
    dtype: str  # torch dtype name, e.g. "float32"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    fingerprint: str
    device_type: str  # a seeded generator's state only resumes on the same kind of device


@dataclass
class KVBundle:
    """A prefilled prompt: its KV per layer ([num_blocks, block_size, kv_heads, head_dim] CPU
    tensors of the prompt's blocks from `first_block` on; the last may be partly filled) and the
    state to continue it. Blocks before `first_block` are left out: the receiver said it had them."""

    request_id: str
    meta: KVMeta
    prompt_token_ids: list[int]
    first_token: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    generator_state: bytes | None = None  # the seeded request's torch.Generator, after the first draw
    first_logprobs: dict[int, Logprob] | None = None
    cumulative_logprob: float = 0.0
    prompt: str | None = None
    first_token_time: float | None = None
    first_block: int = 0

    @property
    def num_blocks(self) -> int:
        return self.layers[0][0].shape[0] if self.layers else 0

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


def engine_meta(engine) -> KVMeta:
    m = engine.model_config
    return KVMeta(
        engine.block_size,
        str(engine.dtype).removeprefix("torch."),
        m.num_layers,
        m.num_kv_heads,
        m.head_dim,
        model_fingerprint(m.path),
        engine.device.type,
    )


@dataclass
class KVTransfer:
    """The engine's export and import hooks; `engine` is its `LLMEngine`, used only through the
    contract's `SequenceEngine` (engine.core.contract)."""

    engine: SequenceEngine
    pending: deque = field(default_factory=deque)  # engine.core.request.EngineRequest with kv_import set
    _meta: KVMeta | None = None
    stats: dict = field(
        default_factory=lambda: {
            "exported": 0,
            "imported": 0,
            "bytes_out": 0,
            "bytes_in": 0,
            "blocks_reused": 0,
            "blocks_not_sent": 0,
            "recomputed": 0,
        }
    )

    @property
    def meta(self) -> KVMeta:
        if self._meta is None:
            self._meta = engine_meta(self.engine)
        return self._meta

    # ---- prefill side ----------------------------------------------------------------------

    def export(self, seq: Sequence):
        """Hand back `seq`'s prompt KV and first token; its blocks return to the pool."""
        eng = self.engine
        n = seq.num_prompt_tokens
        # at most the full blocks before the last token's: a bundle always has a block
        skip = min(max(0, int(_transfer_params(seq).get("skip_blocks", 0))), (n - 1) // eng.block_size)
        blocks = torch.tensor(seq.block_table[skip : cdiv(n, eng.block_size)], dtype=torch.long, device=eng.device)
        layers = [(k.index_select(0, blocks).cpu(), v.index_select(0, blocks).cpu()) for k, v in eng.kv_caches()]
        state = seq.generator.get_state().numpy().tobytes() if seq.generator is not None else None
        req = eng.detach_request(seq.request_id)
        bundle = KVBundle(
            seq.request_id,
            self.meta,
            seq.token_ids[:n],
            seq.token_ids[n],
            layers,
            state,
            seq.logprobs[0] if seq.logprobs else None,
            seq.cumulative_logprob,
            req.prompt,
            seq.first_token_time,
            skip,
        )
        eng.scheduler.finish(seq)
        self.stats["exported"] += 1
        self.stats["bytes_out"] += bundle.nbytes
        out = eng.request_output(req)
        out.finished = False
        out.kv_export = bundle
        return out

    # ---- decode side -----------------------------------------------------------------------

    @staticmethod
    def check_params(params) -> None:
        """Only single-sequence requests without prompt logprobs are split (a worker runs the rest
        in one engine)."""
        if params.n != 1 or params.prompt_logprobs is not None:
            raise ValueError("a request split between prefill and decode has n=1 and no prompt_logprobs")

    def check(self, bundle: KVBundle, params) -> None:
        """Raise ValueError if this engine cannot continue `bundle` with `params`."""
        if bundle.meta != self.meta:
            raise ValueError(
                f"KV of request {bundle.request_id!r} does not fit this engine: {bundle.meta} != {self.meta}"
            )
        self.check_params(params)
        expect = cdiv(len(bundle.prompt_token_ids), bundle.meta.block_size) - bundle.first_block
        if bundle.first_block < 0 or expect < 1:
            raise ValueError(f"KV of request {bundle.request_id!r} has a bad first_block {bundle.first_block}")
        shape = (expect, bundle.meta.block_size, bundle.meta.num_kv_heads, bundle.meta.head_dim)
        if len(bundle.layers) != bundle.meta.num_layers or any(
            tuple(t.shape) != shape or str(t.dtype) != f"torch.{bundle.meta.dtype}" for kv in bundle.layers for t in kv
        ):
            raise ValueError(
                f"KV of request {bundle.request_id!r} has the wrong shape (want {shape} "
                f"x {bundle.meta.num_layers} layers)"
            )

    def drop(self, req) -> bool:
        """Forget a pending import (an abort); False if `req` is not one."""
        if req.kv_import is None:
            return False
        self.pending.remove(req)
        return True

    def admit(self) -> list:
        """Move pending imports into the running set while the pool and the sequence cap allow, in
        arrival order; returns the outputs of any that the first token already finished."""
        eng, finished = self.engine, []
        sched, bm = eng.scheduler, eng.block_manager
        while self.pending and len(sched.running) < sched.max_num_seqs:
            req = self.pending[0]
            seq, bundle = req.seqs[0], req.kv_import
            hits = self._cached_prefix(seq)
            if len(hits) < bundle.first_block:  # blocks it counted on were evicted meanwhile
                self.pending.popleft()
                req.kv_import = None
                out = self._recompute(seq, bundle)
                if out is not None:
                    finished.append(out)
                continue
            need = len(seq) + 1  # the prompt and the first token
            if not bm.can_hold(seq, need, hits):
                break
            self.pending.popleft()
            req.kv_import = None
            bm.take_prefix(seq, hits)
            bm.grow(seq, need)
            self._write(seq, bundle, len(hits))
            seq.num_computed_tokens = seq.num_prompt_tokens
            bm.register_full_blocks(seq)
            seq.status = SequenceStatus.RUNNING
            sched.running.append(seq)
            out = self._accept_first_token(seq, bundle)
            if out is not None:
                finished.append(out)
        return finished

    def _recompute(self, seq: Sequence, bundle: KVBundle):
        """Continue without the KV: the sequence, first token included, is computed here like a
        preempted one (the same tokens, the same generator state)."""
        self.stats["recomputed"] += 1
        self.engine.scheduler.add(seq)
        return self._accept_first_token(seq, bundle)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        bm = self.engine.block_manager
        if not bm.enable_prefix_caching:
            return []
        hits = []
        for i in range(seq.num_prompt_tokens // bm.block_size):
            block = bm.cached.get(bm.block_hash(seq, i))
            if block is None:
                break
            hits.append(block)
        return hits

    def _write(self, seq: Sequence, bundle: KVBundle, skip: int) -> None:
        eng = self.engine
        first, end = bundle.first_block, bundle.first_block + bundle.num_blocks
        if skip < end:  # skip >= first: the blocks before the bundle's are among the cached ones
            dst = torch.tensor(seq.block_table[skip:end], dtype=torch.long, device=eng.device)
            for (k, v), (bk, bv) in zip(eng.kv_caches(), bundle.layers):
                k.index_copy_(0, dst, bk[skip - first :].to(eng.device, non_blocking=True))
                v.index_copy_(0, dst, bv[skip - first :].to(eng.device, non_blocking=True))
        self.stats["imported"] += 1
        self.stats["bytes_in"] += bundle.nbytes
        self.stats["blocks_reused"] += skip
        self.stats["blocks_not_sent"] += first
        seq.num_cached_tokens = skip * eng.block_size

    def _accept_first_token(self, seq: Sequence, bundle: KVBundle):
        eng = self.engine
        if bundle.generator_state is not None:
            seq.generator = torch.Generator(device=eng.device)
            seq.generator.set_state(torch.frombuffer(bytearray(bundle.generator_state), dtype=torch.uint8))
        seq.append_token(bundle.first_token)
        seq.first_token_time = bundle.first_token_time or seq.first_token_time
        if seq.logprobs is not None and bundle.first_logprobs is not None:
            seq.logprobs.append(bundle.first_logprobs)
            seq.cumulative_logprob = bundle.cumulative_logprob
        eng.check_stop(seq)
        return eng.request_done(seq) if seq.is_finished else None
