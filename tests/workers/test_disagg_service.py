"""A decode worker's engine host prefilling on a prefill worker's (workers.disagg.remote_prefill,
workers.disagg.prefill_service, workers.disagg.prefill_registry over real Redis and TCP), in one process."""

from __future__ import annotations

import os
import secrets
import time

import pytest
from prometheus_client import generate_latest

from engine import LLMEngine, SamplingParams
from pagedbatch.embedded import LOCAL_REDIS, servers_or_embedded
from tests.helpers import assert_pool_free, make_prompts
from workers.disagg.kv_transport import bundle_messages
from workers.disagg.kv_zmq import ZmqTransport
from workers.disagg.prefill_registry import Heartbeat, PrefillRegistry
from workers.disagg.prefill_service import PrefillServer
from workers.disagg.remote_prefill import RemotePrefill
from workers.host.engine_host import EngineHost
from workers.metrics.disagg import DisaggCollector
from workers.metrics.series import WorkerMetrics

pytestmark = pytest.mark.platform  # needs Redis (the prefill registry)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    _, url, stops = servers_or_embedded(
        tmp_path_factory.mktemp("redis"), redis_url=os.environ.get("PAGEDBATCH_TEST_REDIS_URL", LOCAL_REDIS)
    )
    yield url
    for stop in stops:
        stop()


def params_for(i: int, n: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.9, seed=i, max_tokens=n, logprobs=1)
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def expected_outputs(path, prompts, max_tokens):
    engine = LLMEngine(str(path))
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params_for(i, n))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: (o.outputs[0].token_ids, o.outputs[0].text) for o in engine.step()})
    return outs


class DyingTransport(ZmqTransport):
    """Sends a bundle's header and first layer, then the worker 'dies' (stops its heartbeat)."""

    heartbeat = None

    def send(self, worker, request_id, bundle, reason=""):
        if bundle is None:
            return super().send(worker, request_id, bundle, reason)
        sock = self._peer(worker)
        for msg in list(bundle_messages(request_id, bundle))[:2]:
            sock.send_multipart(msg, copy=False)
        self.heartbeat.stop()


class Pair:
    def __init__(self, path, redis_url, transport_cls=ZmqTransport, max_pending=256, **decode_kwargs):
        model = f"disagg-{secrets.token_hex(4)}"
        self.registry = PrefillRegistry.from_url(redis_url, model, liveness_s=1.0)
        self.prefill_host = EngineHost(lambda: LLMEngine(str(path)))
        self.prefill_transport = transport_cls()
        self.server = PrefillServer(self.prefill_host, self.prefill_transport, max_pending=max_pending)
        self.heartbeat = Heartbeat(self.registry, self.server.address)
        self.prefill_transport.heartbeat = self.heartbeat
        self.decode_host = EngineHost(lambda: LLMEngine(str(path), **decode_kwargs))
        self.remote = RemotePrefill(
            self.decode_host.engine, self.registry, ZmqTransport(), max_in_flight=4, kv_timeout_s=20
        )
        self.decode_host.remote_prefill = self.remote

    def run(self, prompts, max_tokens):
        futures = self.decode_host.submit_many(
            [(f"r{i}", {"prompt_token_ids": p}, params_for(i, n)) for i, (p, n) in enumerate(zip(prompts, max_tokens))]
        )
        return {
            o.request_id: (o.outputs[0].token_ids, o.outputs[0].text) for o in (f.result(timeout=120) for f in futures)
        }

    def close(self):
        self.remote.close()
        self.remote.transport.close()
        self.decode_host.close()
        self.heartbeat.stop()
        self.server.close()
        self.prefill_transport.close()
        self.prefill_host.close()


def test_decode_host_prefills_remotely_and_matches(tiny_model, redis_url):
    path = tiny_model("qwen2")
    prompts, max_tokens = make_prompts(seed=8, count=10, shared_prefixes=True)
    max_tokens[3] = 1  # finished by its first token: the prefill worker refuses to hand it over
    pair = Pair(path, redis_url, num_kv_blocks=60)  # pacing: not every prompt's KV fits at once
    decode_metrics, prefill_metrics = WorkerMetrics("m"), WorkerMetrics("m")
    decode_metrics.watch(pair.decode_host)
    prefill_metrics.watch(pair.prefill_host)
    decode_metrics.registry.register(DisaggCollector("m", remote=pair.remote, engine=pair.decode_host.engine))
    prefill_metrics.registry.register(DisaggCollector("m", server=pair.server))
    try:
        assert pair.run(prompts, max_tokens) == expected_outputs(path, prompts, max_tokens)
        assert pair.remote.stats["remote"] == len(prompts) - 1 and pair.remote.stats["local_fallbacks"] == 1
        engine = pair.decode_host.engine
        assert engine.kv.stats["imported"] == len(prompts) - 1
        assert engine.kv.stats["blocks_not_sent"] > 0  # shared prefixes this engine had cached were not sent
        assert pair.server.stats["exported"] == len(prompts) - 1 and pair.server.stats["refused"] == 1
        assert pair.remote.stats["kv_bytes"] == engine.kv.stats["bytes_in"] > 0
        assert len(pair.remote.transport.inbox) == 0
        assert_pool_free(engine)
        assert_pool_free(pair.prefill_host.engine)
        decode_text = generate_latest(decode_metrics.registry).decode()
        prefill_text = generate_latest(prefill_metrics.registry).decode()
        kv_bytes = engine.kv.stats["bytes_in"]
        assert f'pagedbatch_kv_transfer_bytes_total{{model="m",side="decode"}} {float(kv_bytes)}' in decode_text
        assert f'pagedbatch_kv_transfer_bytes_total{{model="m",side="prefill"}} {float(kv_bytes)}' in prefill_text
        assert 'pagedbatch_remote_prefills_total{model="m",side="decode"} 9.0' in decode_text
        assert 'pagedbatch_time_to_first_token_seconds_count{model="m",side="prefill"} 9.0' in prefill_text
        # the refused one ran here; the nine imported ones have their first token from elsewhere
        assert 'pagedbatch_time_to_first_token_seconds_count{model="m",side="local"} 1.0' in decode_text
        assert 'pagedbatch_time_per_output_token_seconds_count{model="m"}' in decode_text
    finally:
        pair.close()


def test_prefill_worker_dying_mid_transfer_means_a_local_prefill(tiny_model, redis_url):
    path = tiny_model("llama")
    prompts, max_tokens = make_prompts(seed=9, count=4)
    pair = Pair(path, redis_url, DyingTransport)
    try:
        assert pair.run(prompts, max_tokens) == expected_outputs(path, prompts, max_tokens)
        engine = pair.decode_host.engine
        assert engine.kv.stats["imported"] == 0  # nothing half-imported
        assert pair.remote.stats["local_fallbacks"] == len(prompts)
        assert len(pair.remote.transport.inbox) == 0
        assert pair.registry.live() == []
        assert_pool_free(engine)
    finally:
        pair.close()


def test_no_prefill_worker_runs_everything_locally(tiny_model, redis_url):
    path = tiny_model("llama")
    registry = PrefillRegistry.from_url(redis_url, f"none-{secrets.token_hex(4)}")
    host = EngineHost(lambda: LLMEngine(str(path)))
    remote = RemotePrefill(host.engine, registry, ZmqTransport())
    host.remote_prefill = remote
    try:
        prompts, max_tokens = make_prompts(seed=10, count=4)
        futures = host.submit_many(
            [(f"r{i}", {"prompt_token_ids": p}, params_for(i, n)) for i, (p, n) in enumerate(zip(prompts, max_tokens))]
        )
        got = {
            o.request_id: (o.outputs[0].token_ids, o.outputs[0].text) for o in (f.result(timeout=60) for f in futures)
        }
        assert got == expected_outputs(path, prompts, max_tokens)
        assert remote.stats == {"remote": 0, "local_fallbacks": 0, "kv_bytes": 0, "transfer_seconds": 0.0}
    finally:
        remote.close()
        remote.transport.close()
        host.close()


def test_abort_during_a_remote_prefill_then_run_again(tiny_model, redis_url):
    """Aborted while their KV is on the way (or just imported): nothing of them stays in the engine;
    started again under the same ids, they finish normally."""
    path = tiny_model("llama")
    prompts, max_tokens = make_prompts(seed=11, count=4)
    prompts, max_tokens = prompts[:4], max_tokens[:4]  # prompts of up to 17 tokens: small bundles

    class SlowTransport(ZmqTransport):
        def __init__(self):
            super().__init__(max_send_mbps=0.1)  # 4 KiB per layer: ~0.3 s a layer

    pair = Pair(path, redis_url, SlowTransport)
    try:
        ids = [f"r{i}" for i in range(len(prompts))]
        futures = pair.decode_host.submit_many(
            [
                (rid, {"prompt_token_ids": p}, params_for(i, n))
                for i, (rid, p, n) in enumerate(zip(ids, prompts, max_tokens))
            ]
        )
        time.sleep(0.3)
        assert pair.decode_host.abort(ids) == len(ids)
        assert [f.result(timeout=5) for f in futures] == [None] * len(ids)
        time.sleep(1.5)  # the aborted transfers end or are dropped
        engine = pair.decode_host.engine
        imported = engine.kv.stats["imported"]
        assert imported < len(ids) and not engine.kv.pending  # at 0.5 Mbit/s most were still on the way
        assert_pool_free(engine)
        assert pair.run(prompts, max_tokens) == expected_outputs(path, prompts, max_tokens)
        assert engine.kv.stats["imported"] > imported  # the second round's KV came over
        assert_pool_free(engine)
    finally:
        pair.close()


def test_a_busy_prefill_worker_refuses_and_the_decode_side_prefills(tiny_model, redis_url):
    path = tiny_model("llama")
    prompts, max_tokens = make_prompts(seed=12, count=6)
    pair = Pair(path, redis_url, max_pending=1)
    try:
        assert pair.run(prompts, max_tokens) == expected_outputs(path, prompts, max_tokens)
        stats = pair.remote.stats
        assert stats["remote"] + stats["local_fallbacks"] == len(prompts)
        assert stats["local_fallbacks"] > 0 and pair.server.stats["refused"] > 0
        assert_pool_free(pair.decode_host.engine)
    finally:
        pair.close()


def test_registry_forgets_silent_workers(redis_url):
    registry = PrefillRegistry.from_url(redis_url, f"reg-{secrets.token_hex(4)}", liveness_s=0.5)
    registry.announce("tcp://a:1")
    beat = Heartbeat(registry, "tcp://b:2")
    try:
        assert registry.live() == ["tcp://a:1", "tcp://b:2"] and registry.alive("tcp://a:1")
        time.sleep(0.8)  # a stopped announcing; b beats every liveness/3
        assert registry.live() == ["tcp://b:2"] and not registry.alive("tcp://a:1")
        assert registry.client.zcard(registry.key) == 1  # the silent one was pruned
    finally:
        beat.stop()
    assert registry.live() == [] and registry.client.zcard(registry.key) == 0
