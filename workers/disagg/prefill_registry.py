"""Which prefill workers serve a model, in Redis: a sorted set per model, address -> last heartbeat
(Redis server time). An address whose heartbeat is older than `liveness_s` is gone: clients skip
it and a decode worker waiting on its KV gives up on it. Stale entries are pruned on read, so the
set never outgrows the live workers plus those that died in the last `liveness_s`."""

from __future__ import annotations

import contextlib
import threading

import redis


def registry_key(model: str) -> str:
    return f"pagedbatch:prefill:{model}"


class PrefillRegistry:
    def __init__(self, client: redis.Redis, model: str, liveness_s: float = 3.0):
        self.client, self.key, self.liveness_s = client, registry_key(model), liveness_s

    @classmethod
    def from_url(cls, url: str, model: str, liveness_s: float = 3.0) -> PrefillRegistry:
        return cls(redis.Redis.from_url(url, socket_timeout=5), model, liveness_s)

    def _now(self) -> float:
        seconds, micros = self.client.time()
        return seconds + micros / 1e6

    def announce(self, address: str) -> None:
        self.client.zadd(self.key, {address: self._now()})

    def withdraw(self, address: str) -> None:
        self.client.zrem(self.key, address)

    def live(self) -> list[str]:
        cutoff = self._now() - self.liveness_s
        self.client.zremrangebyscore(self.key, "-inf", cutoff)
        return sorted(a.decode() for a in self.client.zrangebyscore(self.key, cutoff, "+inf"))

    def alive(self, address: str) -> bool:
        try:
            score = self.client.zscore(self.key, address)
            return score is not None and score >= self._now() - self.liveness_s
        except redis.RedisError:
            return True  # Redis down says nothing about the prefill worker; the KV timeout still applies


class Heartbeat:
    """Announces `address` every liveness_s / 3 seconds until `stop()` (which withdraws it)."""

    def __init__(self, registry: PrefillRegistry, address: str):
        self.registry, self.address = registry, address
        self._stop = threading.Event()
        registry.announce(address)
        self._thread = threading.Thread(target=self._run, name="prefill-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.registry.liveness_s / 3):
            with contextlib.suppress(redis.RedisError):  # retried at the next beat
                self.registry.announce(self.address)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(redis.RedisError):
            self.registry.withdraw(self.address)
