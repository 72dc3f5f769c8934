"""Prometheus series of the prefill/decode split, read at scrape time from a decode worker's
`RemotePrefill` and a prefill worker's `PrefillServer` (and the engine's import counters)."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily

from engine.core.contract import StepEngine


class DisaggCollector:
    def __init__(self, model: str, remote=None, server=None, engine: StepEngine | None = None):
        self.model, self.remote, self.server, self.engine = model, remote, server, engine

    def _counter(self, name: str, doc: str, side: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model", "side"])
        c.add_metric([self.model, side], value)
        return c

    def collect(self):
        if self.remote is not None:
            s = self.remote.stats
            yield self._counter(
                "pagedbatch_kv_transfer_bytes", "KV bytes moved between workers", "decode", s["kv_bytes"]
            )
            yield self._counter(
                "pagedbatch_kv_transfer_seconds",
                "Time from asking for a prefill to holding its KV (decode) or sending KV (prefill)",
                "decode",
                s["transfer_seconds"],
            )
            yield self._counter(
                "pagedbatch_remote_prefills", "Requests prefilled on a prefill worker", "decode", s["remote"]
            )
            yield self._counter(
                "pagedbatch_remote_prefill_fallbacks",
                "Requests prefilled here after a remote prefill failed or was refused",
                "decode",
                s["local_fallbacks"],
            )
        if self.engine is not None:
            kv = self.engine.kv_transfer_stats()
            yield self._counter(
                "pagedbatch_kv_blocks_reused",
                "Imported KV blocks already in the prefix cache",
                "decode",
                kv["blocks_reused"],
            )
            yield self._counter(
                "pagedbatch_kv_blocks_not_sent",
                "Prompt KV blocks not sent because this worker had them cached",
                "decode",
                kv["blocks_not_sent"],
            )
        if self.server is not None:
            s = self.server.stats
            yield self._counter(
                "pagedbatch_kv_transfer_bytes", "KV bytes moved between workers", "prefill", s["bytes_sent"]
            )
            yield self._counter(
                "pagedbatch_kv_transfer_seconds",
                "Time from asking for a prefill to holding its KV (decode) or sending KV (prefill)",
                "prefill",
                s["send_seconds"],
            )
            yield self._counter("pagedbatch_prefills_served", "Prefills whose KV was sent", "prefill", s["exported"])
