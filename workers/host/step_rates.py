"""A worker's measured throughput, for quotes and ETAs: the engine's step times against what each step computed.

Every step adds to running sums from the engine's own counters (`stats`: `tokens` computed, `batched_seqs`): a
step's decode tokens are about its sequences, its prefill tokens the rest. The sums are what the heartbeat
publishes (`store.models_registry`); `store.lifecycle.quotes` fits step seconds = overhead + tokens computed x a
on them by least squares, so a job's run time follows from its uncached prompt tokens, its completion tokens
and its decode steps.
"""

from __future__ import annotations

import contextlib
import threading

FIELDS = ("n", "p", "d", "y", "pp", "pd", "dd", "py", "dy")  # steps, their sums and products (least squares)
DECAY = 0.999  # old steps weigh less, so the fit follows the current load (about the last thousand steps)


class StepRates:
    def __init__(self):
        self._lock = threading.Lock()
        self._sums = dict.fromkeys(FIELDS, 0.0)
        self._last = (0, 0)
        self.busy_s = 0.0
        self.pool: dict = {}  # the KV pool's shape: blocks, block size, sequences per step

    def observe(self, engine, seconds: float) -> int:
        """One engine step of `engine` took `seconds`; returns its prompt tokens (0: a step of decodes only)."""
        stats = engine.stats
        tokens, seqs = stats.get("tokens", 0), stats.get("batched_seqs", 0)
        if not self.pool:
            try:
                self.pool = {"block_size": engine.block_size, "max_num_seqs": engine.max_num_seqs, "blocks": 0}
            except Exception:  # an engine double without them: rates only
                self.pool = {"blocks": 0}
        with contextlib.suppress(Exception):  # idle after a step: every block free, the pool's size
            self.pool["blocks"] = max(self.pool["blocks"], engine.num_free_blocks())
        d = max(0, seqs - self._last[1])
        p = max(0, tokens - self._last[0] - d)
        self._last = (tokens, seqs)
        if p == 0 and d == 0:
            return 0
        terms = {"n": 1, "p": p, "d": d, "y": seconds, "pp": p * p, "pd": p * d, "dd": d * d}
        terms |= {"py": p * seconds, "dy": d * seconds}
        with self._lock:
            self.busy_s += seconds
            for name, value in terms.items():
                self._sums[name] = self._sums[name] * DECAY + value
        return p

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._sums, busy_s=self.busy_s, pool=dict(self.pool))
