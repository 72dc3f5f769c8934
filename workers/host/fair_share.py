"""Fair share across tenants inside one worker: which waiting request enters the engine next.

Requests wait in one queue per tenant. When the engine has room, the next request comes from the tenant
with the fewest requests in the engine per unit of weight (the tenant's `weight` in the database, set with
`pagedbatch tenants set NAME --weight W` and carried with each shard's requests; default 1). Within a
tenant, the job's `priority` orders its queue (vLLM's meaning: a lower value first; default 0), then the
earliest deadline (the end of the job's `completion_window`), then the oldest first: priority never crosses
tenants, where the weights rule. A few engine slots (`reserve`) are
kept for tenants that hold less than the rest, so that a small job of one tenant starts at once beside a
large job of another instead of waiting for the large job's running requests to finish. A tenant alone in
the worker borrows the reserve (a worker serving one tenant runs as many requests as the engine holds: a
reserve of 16 of 256 slots had cost it 6% of its throughput); when another tenant's requests arrive, the
borrowed slots are given back at once (`to_reclaim`): the latest of the big tenant's requests leave the
engine, their work so far dropped, and wait first in its queue.
PAGEDBATCH_FAIR_SHARE=0 turns it off: every request enters the engine at once, first come first served.

Admission alone is not enough: a step's cost grows with its batch, so a small job's few requests
decoding beside a large job's hundreds wait for the large batch at every token. So the engine is time
sliced: while a tenant holding few requests (per weight, at most 1/SMALL_FACTOR of the biggest) shares
the engine with tenants holding many, the big tenants' requests are paused (they keep their KV blocks)
and the small tenants' steps run alone, for as long as the time the big tenants' steps earned allows:
PAGEDBATCH_FAIR_SLICE (default 1, 0 turns pausing off) seconds of paused stepping per second of
unpaused stepping, at most PAGEDBATCH_FAIR_BURST_S (default 0.5) saved up. The big tenants thus keep at
least 1/(1 + slice) of the engine's time, whatever the small ones send.

A step is never interrupted, so a newcomer waits for each step it shares, which where a step's cost grows
with its batch (a small model on CPU) can last several times the newcomer's whole job. So while another
tenant's requests are in the engine, the requests of a big tenant (holding more than a quarter of the
engine) step in a rotating window sized to make a step last about PAGEDBATCH_FAIR_STEP_FACTOR (default 4;
0 turns it off) times the engine's fixed cost per step, both measured (the smoothed duration of small steps
of decodes, and the cost of each request more, from big steps of decodes); the others keep their KV and sit
the step out. Each window pays the fixed cost again, so at most about 1/factor of the big tenants'
throughput goes, for a newcomer's steps bounded by about `factor` fixed costs (its first waits for the step
under way). A tenant alone is never split: nobody would gain. Where a step's cost hardly grows with its
batch (a GPU, a big model) the window exceeds the engine: nothing is split.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field

from settings import WorkerSettings, current

INF = float("inf")  # no deadline: after every request that has one
SMALL_FACTOR = 4  # a tenant holding at most 1/4 of what another holds (per weight) gets steps of its own


def check_weight(weight) -> float:
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < float("inf"):
        raise ValueError(f"a tenant's weight is a positive number, got {weight!r:.40}")
    return float(weight)


@dataclass
class FairShare:
    enabled: bool = True
    capacity: int = 256  # requests in the engine at once (the engine's max_num_seqs)
    reserve: int = 16  # of those, kept for tenants holding fewer than the others
    weights: dict[str, float] = field(default_factory=dict)  # tenants' weights (absent: 1), as last pushed
    slice_ratio: float = 1.0  # seconds of paused stepping earned per second of unpaused stepping
    burst_s: float = 0.5  # at most this much of it saved up
    step_factor: float = 4.0  # a big tenant's steps last about this many fixed costs per step; 0: off
    _queues: dict[str, list] = field(default_factory=dict)  # tenant -> heap of (priority, deadline, order, request id)
    _order: itertools.count = field(default_factory=itertools.count)
    _credit: float = 0.0
    _fixed_s: float = 0.0  # smoothed duration of small steps: the engine's fixed cost per step
    _per_request_s: float = 0.0  # smoothed cost of each request in a step beyond the fixed cost
    _rotation: int = 0
    _split: bool = False  # the last step ran a window of a big tenant's requests

    @classmethod
    def from_env(cls, capacity: int) -> FairShare:
        env = current(WorkerSettings)
        reserve = env.fair_reserve if env.fair_reserve is not None else max(1, capacity // 16)
        return cls(
            enabled=env.fair_share,
            capacity=capacity,
            reserve=max(0, min(reserve, capacity - 1)),
            slice_ratio=env.fair_slice,
            burst_s=env.fair_burst_s,
            step_factor=env.fair_step_factor,
        )

    def push(
        self,
        tenant: str,
        request_id: str,
        priority: int = 0,
        weight: float | None = None,
        deadline: float | None = None,
        front: bool = False,
    ) -> None:
        """Queue a request of `tenant`: `priority` orders the tenant's queue (lower first, then the earliest
        `deadline` (Unix seconds; None: none), then the oldest; `front`: before the others of its priority);
        `weight` becomes the tenant's weight (None keeps it: 1 unless one was pushed)."""
        if weight is not None:
            self.weights[tenant] = check_weight(weight)
        order = -next(self._order) if front else next(self._order)
        heapq.heappush(self._queues.setdefault(tenant, []), (priority, deadline or INF, order, request_id))

    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def next(self, running: Counter, in_engine: int, lend: bool = True) -> tuple[str, str] | None:
        """(tenant, request id) to put into the engine now, taken off its queue; None: no room or none waiting.

        `running` counts each tenant's requests in the engine, `in_engine` all of them. `lend`: a tenant alone
        may borrow the reserve (the caller gives it back with `to_reclaim`)."""
        tenants = [t for t, q in self._queues.items() if q]
        if not tenants or in_engine >= self.capacity:
            return None
        tenant = min(tenants, key=lambda t: running[t] / self.weights.get(t, 1.0))
        others = [n for t, n in running.items() if t != tenant and n]
        holds_most = running[tenant] > 0 and (not others or running[tenant] >= max(others))
        alone = lend and not others and len(tenants) == 1  # it borrows the reserve until another tenant comes
        if in_engine >= self.capacity - self.reserve and holds_most and not alone:
            return None  # the reserve is for a tenant that holds less
        queue = self._queues[tenant]
        request_id = heapq.heappop(queue)[-1]
        if not queue:
            del self._queues[tenant]
            self._forget_idle(running, keep=tenant)
        return tenant, request_id

    def to_reclaim(self, running: Counter, in_engine: int) -> tuple[str, int] | None:
        """(tenant, count): how many of the biggest tenant's requests leave the full engine now, the reserve it
        borrowed while alone given back to the tenants whose requests wait with none in the engine; None: none."""
        if not self.enabled or self.reserve <= 0 or in_engine < self.capacity or not running:
            return None
        newcomers = sum(len(q) for t, q in self._queues.items() if not running[t])
        tenant, held = max(running.items(), key=lambda item: item[1])
        count = min(held - (self.capacity - self.reserve), newcomers, self.reserve)
        return (tenant, count) if count > 0 else None

    def _forget_idle(self, running: Counter, keep: str) -> None:
        """Drop the weights of tenants with nothing queued or running (they come back with their next push),
        so that the map holds no more tenants than the worker serves."""
        for tenant in [t for t in self.weights if t != keep and t not in self._queues and not running[t]]:
            del self.weights[tenant]

    def to_pause(self, running: Counter) -> set[str]:
        """Tenants whose requests sit out the next step (see the module's docstring); `running` as in next()."""
        if not self.enabled or self.slice_ratio <= 0 or self._credit <= 0:
            return set()
        share = {t: n / self.weights.get(t, 1.0) for t, n in running.items() if n}
        if len(share) < 2:
            return set()
        smallest = min(share.values())
        return {t for t, s in share.items() if s > SMALL_FACTOR * smallest}

    @property
    def big(self) -> int:
        """A tenant holding more requests than this is big: with a step factor, its requests step in windows."""
        return max(self.reserve, self.capacity // SMALL_FACTOR)

    def window(self) -> int | None:
        """How many requests a step may hold to last about `step_factor` fixed costs; None: no limit (yet)."""
        if self.step_factor <= 1 or not self._fixed_s or not self._per_request_s:
            return None
        return max(1, int((self.step_factor - 1) * self._fixed_s / self._per_request_s))

    def may_split(self, running: Counter) -> bool:
        """Whether `to_split` may split a step with `running` in the engine (else the host need not list who
        steps): a window is measured and more than one tenant is there."""
        return self.enabled and self.window() is not None and sum(1 for n in running.values() if n) > 1

    def to_split(self, stepping: dict[str, list[str]]) -> set[str]:
        """Of the requests about to step ({tenant: request ids}), those of big tenants outside this step's
        window (see the module's docstring): they sit the step out."""
        self._split = False
        window = self.window()
        if not self.enabled or window is None or len(stepping) < 2:  # a tenant alone is never split
            return set()
        big = sorted(rid for ids in stepping.values() if len(ids) > self.big for rid in ids)
        room = max(1, window - sum(len(ids) for ids in stepping.values() if len(ids) <= self.big))
        if room >= len(big):
            return set()
        start = self._rotation % len(big)
        self._rotation = start + room
        self._split = True
        return set(big) - {big[(start + k) % len(big)] for k in range(room)}

    def stepped(self, seconds: float, paused: bool, stepping: int = 0, prompt_tokens: int = 0) -> None:
        """Account one engine step of `stepping` requests: a paused one spends saved time, an unpaused one earns
        it; with a step factor, its duration refines the costs that size the windows. Only steps of decodes
        (no `prompt_tokens`) measure them, and a request's cost only from a big step: a prompt's tokens, or the
        noise of a step of a few requests spread over each, had measured requests at ten times their cost, and
        windows of 10 of 256 requests (each window's steps then measured the same way) cut a tenant's throughput."""
        if paused:
            self._credit -= seconds
        else:
            self._credit = min(self.burst_s, self._credit + seconds * self.slice_ratio)
        if self.step_factor <= 0 or seconds <= 0 or stepping <= 0 or prompt_tokens:
            return
        if stepping <= self.reserve and not self._split:  # a small step: mostly the fixed cost
            self._fixed_s = _smoothed(self._fixed_s, seconds)
        elif self._fixed_s and stepping > self.big:
            self._per_request_s = _smoothed(self._per_request_s, max(seconds - self._fixed_s, 0.0) / stepping)


def _smoothed(average: float, value: float, weight: float = 0.2) -> float:
    return value if not average else (1 - weight) * average + weight * value
