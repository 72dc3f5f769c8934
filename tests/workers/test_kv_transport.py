"""The KV transfer path (engine/kv_transfer/wire.py, workers/disagg/kv_transport.py, workers/disagg/kv_zmq.py): bundles
arrive whole or not at all, over function calls and over TCP."""

import socket
import time

import pytest
import torch

from engine import SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.kv_transfer.export import KVBundle, KVMeta
from engine.params.outputs import Logprob
from tests.helpers import wait_until
from workers.disagg.kv_transport import InProcessTransport, bundle_messages
from workers.disagg.kv_zmq import ZmqTransport


def fake_bundle(rid="r1", dtype=torch.bfloat16, prompt_len=37, layers=3, first_block=0):
    meta = KVMeta(16, str(dtype).removeprefix("torch."), layers, 2, 8, "f" * 32, "cpu")
    shape = (3 - first_block, 16, 2, 8)
    kv = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(layers)]
    return KVBundle(
        rid,
        meta,
        list(range(prompt_len)),
        5,
        kv,
        b"\x01\x02state",
        {5: Logprob(-0.5, 1, "x")},
        -0.5,
        "text",
        123.0,
        first_block,
    )


def assert_same_bundle(a: KVBundle, b: KVBundle):
    assert (
        a.request_id,
        a.meta,
        a.prompt_token_ids,
        a.first_token,
        a.generator_state,
        a.first_logprobs,
        a.cumulative_logprob,
        a.prompt,
        a.first_token_time,
        a.first_block,
    ) == (
        b.request_id,
        b.meta,
        b.prompt_token_ids,
        b.first_token,
        b.generator_state,
        b.first_logprobs,
        b.cumulative_logprob,
        b.prompt,
        b.first_token_time,
        b.first_block,
    )
    assert len(a.layers) == len(b.layers)
    for (ka, va), (kb, vb) in zip(a.layers, b.layers):
        assert ka.dtype == kb.dtype and torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.fixture(params=["inprocess", "zmq"])
def pair(request):
    if request.param == "inprocess":
        registry = {}
        a, b = InProcessTransport("p", registry), InProcessTransport("d", registry)
    else:
        a, b = ZmqTransport(), ZmqTransport()
    yield a, b
    a.close()
    b.close()


def test_round_trip(pair):
    sender, receiver = pair
    for dtype, first_block in ((torch.bfloat16, 0), (torch.float32, 2), (torch.float16, 1)):
        bundle = fake_bundle(f"r-{dtype}", dtype, first_block=first_block)
        receiver.expect(bundle.request_id)
        sender.send(receiver.address, bundle.request_id, bundle)
        got, why = receiver.receive(bundle.request_id, timeout=5)
        assert why is None
        assert_same_bundle(got, bundle)
        receiver.release(bundle.request_id)
    assert len(receiver.inbox) == 0
    assert sender.bytes_sent == receiver.inbox.bytes_received > 0


def test_refusal_and_unasked(pair):
    sender, receiver = pair
    sender.send(receiver.address, "nobody-asked", fake_bundle("nobody-asked"))
    receiver.expect("r2")
    sender.send(receiver.address, "r2", None, "finished on the prefill side")
    assert receiver.receive("r2", timeout=5) == (None, "finished on the prefill side")
    assert len(receiver.inbox) == 1  # only what it asked for
    receiver.release("r2")
    assert len(receiver.inbox) == 0


def test_sender_dying_mid_transfer_leaves_nothing():
    """Header and some layers, then silence: never a bundle; `alive` ends the wait early."""
    registry = {}
    receiver = InProcessTransport("d", registry)
    msgs = list(bundle_messages("r3", fake_bundle("r3")))
    receiver.expect("r3")
    for m in msgs[:2]:  # the header and layer 0 of 3
        receiver.inbox.feed([bytes(f) for f in m])
    started = time.monotonic()
    assert receiver.receive("r3", timeout=0.3) == (None, "no KV progress for 0.3 s")
    assert receiver.receive("r3", timeout=60, alive=lambda: False) == (None, "the sender is gone")
    assert time.monotonic() - started < 5
    receiver.inbox.feed([bytes(f) for f in msgs[-1]])  # an end without every layer
    assert receiver.receive("r3", timeout=1)[1].startswith("bad KV message")
    receiver.release("r3")
    assert len(receiver.inbox) == 0


def test_malformed_messages_fail_the_request_only():
    receiver = InProcessTransport("d", {})
    msgs = [[bytes(f) for f in m] for m in bundle_messages("r4", fake_bundle("r4"))]
    receiver.expect("r4")
    receiver.inbox.feed(msgs[0])
    receiver.inbox.feed([b"L", b"r4", b"0", b"short", b"short"])
    assert "expected" in receiver.receive("r4", timeout=1)[1]
    receiver.expect("r5")
    receiver.inbox.feed([b"H", b"r5", b"{not json"])
    assert "bad KV header" in receiver.receive("r5", timeout=1)[1]


def test_engine_to_engine_over_tcp(tiny_model):
    """A real prefill engine's bundle crosses TCP and the decode engine finishes it like one engine."""
    path = str(tiny_model("qwen3"))
    prompt = {"prompt_token_ids": list(range(3, 60))}
    params = dict(temperature=0.8, seed=3, max_tokens=12)
    single = LLMEngine(path, num_kv_blocks=64)
    single.add_request("a", prompt, SamplingParams(**params))
    expected = [o for _ in range(40) for o in single.step()][0].outputs[0].token_ids
    prefill = LLMEngine(path, num_kv_blocks=64)
    prefill.add_request(
        "a", prompt, SamplingParams(**params, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    )
    bundle = [o for _ in range(5) for o in prefill.step()][0].kv_export
    sender, receiver = ZmqTransport(), ZmqTransport()
    try:
        receiver.expect("a")
        sender.send(receiver.address, "a", bundle)
        got, why = receiver.receive("a", timeout=10)
        assert why is None
        decode = LLMEngine(path, num_kv_blocks=64)
        decode.add_imported_request("a", got, SamplingParams(**params))
        out = [o for _ in range(40) for o in decode.step()][0]
        assert out.outputs[0].token_ids == expected
    finally:
        sender.close()
        receiver.close()


def refuses(address: str) -> bool:
    """Whether nothing listens at `address` any more. zmq closes a socket's listener on its I/O thread, after
    close() returns: a DEALER that connects meanwhile is accepted and its sends queue into a pipe that then
    dies, as if the peer were alive."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=0.5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_send_to_a_dead_endpoint_fails_fast_and_holds_nothing():
    sender = ZmqTransport(send_timeout_s=0.3, retry_after_s=30)
    receiver = ZmqTransport()
    address = receiver.address
    receiver.close()  # nobody listens there any more, once zmq's I/O thread has closed the listener
    wait_until(lambda: refuses(address), timeout=5, what=f"{address} to refuse connections")
    try:
        started = time.monotonic()
        with pytest.raises(ConnectionError, match="timed out"):
            sender.send(address, "r", fake_bundle("r"))
        with pytest.raises(ConnectionError, match="skipping"):
            sender.send(address, "r2", fake_bundle("r2"))
        assert time.monotonic() - started < 5 and not sender._peers
    finally:
        sender.close()
