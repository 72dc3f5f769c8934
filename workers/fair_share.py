"""Fair share across tenants inside one worker: which waiting request enters the engine next.

Requests wait in one queue per tenant. When the engine has room, the next request comes from the tenant
with the fewest requests in the engine per unit of weight (PAGEDBATCH_TENANT_WEIGHTS, e.g. "a=2,b=1";
default 1), the oldest first within a tenant. A few engine slots (`reserve`) are kept for tenants that
hold less than the rest, so that a small job of one tenant starts at once beside a large job of another
instead of waiting for the large job's running requests to finish. PAGEDBATCH_FAIR_SHARE=0 turns it off:
every request enters the engine at once, first come first served.
"""

from __future__ import annotations

import os
from collections import Counter, deque
from dataclasses import dataclass, field


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
    _queues: dict[str, deque] = field(default_factory=dict)

    @classmethod
    def from_env(cls, capacity: int) -> FairShare:
        env = os.environ
        reserve = int(env.get("PAGEDBATCH_FAIR_RESERVE") or max(1, capacity // 16))
        return cls(
            enabled=env.get("PAGEDBATCH_FAIR_SHARE", "1") != "0",
            capacity=capacity,
            reserve=max(0, min(reserve, capacity - 1)),
            weights=parse_weights(env.get("PAGEDBATCH_TENANT_WEIGHTS", "")),
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
