"""A `KVBundle` as bytes: one JSON header (metadata, first token, sampling state) and two raw
buffers per layer (K and V, C order), so a transport can ship it layer by layer. `KVAssembler`
rebuilds the bundle on the other side and refuses an incomplete or malformed one."""

from __future__ import annotations

import base64
import json
from dataclasses import asdict

import numpy as np
import torch

from engine.core.block_manager import cdiv
from engine.kv_transfer.export import KVBundle, KVMeta
from engine.params.outputs import Logprob


def encode_header(bundle: KVBundle) -> bytes:
    state = base64.b64encode(bundle.generator_state).decode() if bundle.generator_state is not None else None
    logprobs = (
        None
        if bundle.first_logprobs is None
        else [[t, lp.logprob, lp.rank, lp.decoded_token] for t, lp in bundle.first_logprobs.items()]
    )
    return json.dumps(
        {
            "request_id": bundle.request_id,
            "meta": asdict(bundle.meta),
            "prompt_token_ids": bundle.prompt_token_ids,
            "first_token": bundle.first_token,
            "generator_state": state,
            "first_logprobs": logprobs,
            "cumulative_logprob": bundle.cumulative_logprob,
            "prompt": bundle.prompt,
            "first_token_time": bundle.first_token_time,
            "first_block": bundle.first_block,
        }
    ).encode()


def layer_buffers(bundle: KVBundle, index: int) -> tuple[memoryview, memoryview]:
    """Layer `index`'s K and V as flat byte views (no copy when the tensors are contiguous)."""
    k, v = bundle.layers[index]
    return tuple(memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B") for t in (k, v))


class KVAssembler:
    """Collects one bundle's header and layers; `bundle()` only once every layer is in."""

    def __init__(self, header: bytes | memoryview):
        try:
            h = json.loads(bytes(header))
            self.meta = KVMeta(**h.pop("meta"))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"bad KV header: {exc}") from None
        self.header = h
        self.dtype = getattr(torch, self.meta.dtype, None)
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"bad KV dtype {self.meta.dtype!r}")
        blocks = cdiv(len(h["prompt_token_ids"]), self.meta.block_size) - int(h.get("first_block", 0))
        if blocks < 1:
            raise ValueError(f"bad KV header: first_block {h.get('first_block')} leaves no block")
        self.shape = (blocks, self.meta.block_size, self.meta.num_kv_heads, self.meta.head_dim)
        self.layer_nbytes = (
            blocks * self.meta.block_size * self.meta.num_kv_heads * self.meta.head_dim * self.dtype.itemsize
        )
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.meta.num_layers

    def add_layer(self, index: int, k: bytes | memoryview, v: bytes | memoryview) -> None:
        if not 0 <= index < len(self.layers) or self.layers[index] is not None:
            raise ValueError(f"unexpected KV layer {index}")
        if len(k) != self.layer_nbytes or len(v) != self.layer_nbytes:
            raise ValueError(f"KV layer {index} has {len(k)}/{len(v)} bytes, expected {self.layer_nbytes}")
        # One copy out of the transport's buffer (numpy's is a plain memcpy).
        self.layers[index] = tuple(
            torch.from_numpy(np.frombuffer(b, np.uint8).copy()).view(self.dtype).view(self.shape) for b in (k, v)
        )

    @property
    def complete(self) -> bool:
        return all(layer is not None for layer in self.layers)

    def bundle(self) -> KVBundle:
        if not self.complete:
            missing = [i for i, layer in enumerate(self.layers) if layer is None]
            raise ValueError(f"KV of request {self.header['request_id']!r} lacks layers {missing}")
        h = self.header
        state = base64.b64decode(h["generator_state"]) if h["generator_state"] is not None else None
        logprobs = (
            None
            if h["first_logprobs"] is None
            else {t: Logprob(lp, rank, text) for t, lp, rank, text in h["first_logprobs"]}
        )
        return KVBundle(
            h["request_id"],
            self.meta,
            h["prompt_token_ids"],
            h["first_token"],
            list(self.layers),
            state,
            logprobs,
            h["cumulative_logprob"],
            h["prompt"],
            h["first_token_time"],
            int(h.get("first_block", 0)),
        )
