"""Fair share across tenants inside one worker: which waiting request enters the engine next.

Requests wait in one queue per tenant. When the engine has room, the next request comes from the tenant
with the fewest requests in the engine per unit of weight (PAGEDBATCH_TENANT_WEIGHTS, e.g. "a=2,b=1";
default 1), the oldest first within a tenant. A few engine slots (`reserve`) are kept for tenants that
hold less than the rest, so that a small job of one tenant starts at once beside a large job of another
instead of waiting for the large job's running requests to finish. PAGEDBATCH_FAIR_SHARE=0 turns it off:
every request enters the engine at once, first come first served.

Admission alone is not enough: a step's cost grows with its batch, so a small job's few requests
decoding beside a large job's hundreds wait for the large batch at every token. So the engine is time
sliced: while a tenant holding few requests (per weight, at most 1/SMALL_FACTOR of the biggest) shares
the engine with tenants holding many, the big tenants' requests are paused (they keep their KV blocks)
and the small tenants' steps run alone, for as long as the time the big tenants' steps earned allows:
PAGEDBATCH_FAIR_SLICE (default 1, 0 turns pausing off) seconds of paused stepping per second of
unpaused stepping, at most PAGEDBATCH_FAIR_BURST_S (default 0.5) saved up. The big tenants thus keep at
least 1/(1 + slice) of the engine's time, whatever the small ones send.
"""

from __future__ import annotations

import os
from collections import Counter, deque
from dataclasses import dataclass, field

SMALL_FACTOR = 4  # a tenant holding at most 1/4 of what another holds (per weight) gets steps of its own


def parse_weights(spec: str) -> dict[str, float]:
    weights = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        tenant, sep, value = item.partition("=")
        if not sep or float(value) <= 0:
            raise ValueError(f"bad tenant weight {item!r}; expected TENANT=POSITIVE_NUMBER")
        weights[tenant.strip()] = float(value)
    return weights


@dataclass
class FairShare:
    enabled: bool = True
    capacity: int = 256  # requests in the engine at once (the engine's max_num_seqs)
    reserve: int = 16  # of those, kept for tenants holding fewer than the others
    weights: dict[str, float] = field(default_factory=dict)
    slice_ratio: float = 1.0  # seconds of paused stepping earned per second of unpaused stepping
    burst_s: float = 0.5  # at most this much of it saved up
    _queues: dict[str, deque] = field(default_factory=dict)
    _credit: float = 0.0

    @classmethod
    def from_env(cls, capacity: int) -> FairShare:
        env = os.environ
        reserve = int(env.get("PAGEDBATCH_FAIR_RESERVE") or max(1, capacity // 16))
        return cls(
            enabled=env.get("PAGEDBATCH_FAIR_SHARE", "1") != "0",
            capacity=capacity,
            reserve=max(0, min(reserve, capacity - 1)),
            weights=parse_weights(env.get("PAGEDBATCH_TENANT_WEIGHTS", "")),
            slice_ratio=max(0.0, float(env.get("PAGEDBATCH_FAIR_SLICE") or 1.0)),
            burst_s=max(0.0, float(env.get("PAGEDBATCH_FAIR_BURST_S") or 0.5)),
        )

    def push(self, tenant: str, request_id: str) -> None:
        self._queues.setdefault(tenant, deque()).append(request_id)

    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def next(self, running: Counter, in_engine: int) -> tuple[str, str] | None:
        """(tenant, request id) to put into the engine now, taken off its queue; None: no room or none waiting.

        `running` counts each tenant's requests in the engine, `in_engine` all of them."""
        tenants = [t for t, q in self._queues.items() if q]
        if not tenants or in_engine >= self.capacity:
            return None
        tenant = min(tenants, key=lambda t: running[t] / self.weights.get(t, 1.0))
        others = [n for t, n in running.items() if t != tenant and n]
        holds_most = running[tenant] > 0 and (not others or running[tenant] >= max(others))
        if in_engine >= self.capacity - self.reserve and holds_most:
            return None  # the reserve is for a tenant that holds less
        queue = self._queues[tenant]
        request_id = queue.popleft()
        if not queue:
            del self._queues[tenant]
        return tenant, request_id

    def to_pause(self, running: Counter) -> set[str]:
        """Tenants whose requests sit out the next step (see the module's docstring); `running` as in next()."""
        if not self.enabled or self.slice_ratio <= 0 or self._credit <= 0:
            return set()
        share = {t: n / self.weights.get(t, 1.0) for t, n in running.items() if n}
        if len(share) < 2:
            return set()
        smallest = min(share.values())
        return {t for t, s in share.items() if s > SMALL_FACTOR * smallest}

    def stepped(self, seconds: float, paused: bool) -> None:
        """Account one engine step: a paused one spends saved time, an unpaused one earns it."""
        if paused:
            self._credit -= seconds
        else:
            self._credit = min(self.burst_s, self._credit + seconds * self.slice_ratio)
