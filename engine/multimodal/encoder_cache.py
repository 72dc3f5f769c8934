"""The vision encoder's outputs by image content hash, least recently used out beyond a token budget:
an image repeated across prompts (or met again after a preemption or in a later prefill chunk) is
encoded once while it stays cached."""

from __future__ import annotations

from collections import OrderedDict


class EncoderCache:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.entries: OrderedDict[bytes, object] = OrderedDict()
        self.tokens = 0
        self.hits = self.misses = 0

    def get(self, key: bytes):
        value = self.entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(key)
        return value

    def put(self, key: bytes, value, pinned=frozenset()) -> None:
        """Keep `value` ([tokens, hidden]); evict the oldest entries not in `pinned` (this step's)."""
        if key in self.entries:
            return
        self.entries[key] = value
        self.tokens += value.shape[0]
        for old in list(self.entries):
            if self.tokens <= self.max_tokens:
                break
            if old in pinned or old == key:
                continue
            self.tokens -= self.entries.pop(old).shape[0]
