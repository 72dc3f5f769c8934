"""Fair share's time slicing (issue 12, finding 4): while a tenant with a few requests shares the engine with
a tenant holding many, the big tenant's requests are paused (keeping their KV) so the small one's steps are
short, within a bounded share of the engine's time; a paused request resumes with the same tokens."""

from __future__ import annotations

import threading
from collections import Counter

from engine import LLMEngine, SamplingParams
from workers.host.engine_host import EngineHost
from workers.host.fair_share import FairShare


def test_big_tenants_pause_beside_a_small_one_while_time_is_saved_up():
    fair = FairShare(capacity=256, reserve=16, slice_ratio=1.0, burst_s=0.5)
    running = Counter(a=240, b=4)
    assert fair.to_pause(running) == set()  # nothing saved up yet
    fair.stepped(0.2, paused=False)
    assert fair.to_pause(running) == {"a"}
    assert fair.to_pause(Counter(a=240)) == set()  # alone: nobody to make room for
    assert fair.to_pause(Counter(a=120, b=100)) == set()  # comparable shares share the steps
    assert fair.to_pause(Counter(a=240, b=4, c=0)) == {"a"}
    fair.stepped(0.15, paused=True)
    fair.stepped(0.1, paused=True)
    assert fair.to_pause(running) == set()  # spent: A's steps come back
    fair.stepped(10.0, paused=False)
    fair.stepped(0.49, paused=True)
    assert fair.to_pause(running) == {"a"}  # saved up to burst_s (0.5 s) only
    fair.stepped(0.02, paused=True)
    assert fair.to_pause(running) == set()
    weighted = FairShare(weights={"a": 100.0}, slice_ratio=1.0)
    weighted.stepped(0.1, paused=False)
    assert weighted.to_pause(running) == set()  # per weight, A holds 2.4 to B's 4
    off = FairShare(slice_ratio=0.0)
    off.stepped(0.1, paused=False)
    assert off.to_pause(running) == set()


def _drain(engine) -> dict:
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
    return outputs


def test_a_paused_request_keeps_its_place_and_resumes_with_the_same_tokens(tiny_model):
    engine = LLMEngine(model=str(tiny_model("qwen3")))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("ref", {"prompt_token_ids": [5, 6, 7, 8]}, params)
    alone = _drain(engine)["ref"].outputs[0].token_ids
    engine.add_request("x", {"prompt_token_ids": [5, 6, 7, 8]}, params)
    engine.add_request("y", {"prompt_token_ids": [9, 10, 11]}, params)
    engine.step()
    engine.step()
    x_seq = next(s for s in engine.scheduler.running if s.request_id == "x")
    made, blocks = len(x_seq.output_token_ids), list(x_seq.block_table)
    engine.pause_requests(["x"])
    for _ in range(5):
        engine.step()
    assert len(x_seq.output_token_ids) == made and x_seq.block_table == blocks  # waited, kept its KV
    engine.pause_requests([])
    outputs = _drain(engine)
    assert len(outputs["y"].outputs[0].token_ids) == 12
    assert outputs["x"].outputs[0].token_ids == alone


def test_a_small_tenant_steps_alone_beside_a_big_tenants_backlog(tiny_model, monkeypatch):
    monkeypatch.setenv("PAGEDBATCH_FAIR_SHARE", "1")
    monkeypatch.setenv("PAGEDBATCH_FAIR_SLICE", "1000")  # plenty of saved time: the outcome is no timing
    engine = LLMEngine(model=str(tiny_model("qwen3")), max_num_seqs=32)
    batches: list[set[str]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        batches.append({seq.request_id for seq in batch.seqs})
        return batch

    engine.scheduler.schedule = recording_schedule
    host = EngineHost(lambda: engine)
    try:
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        a = host.submit_many([(f"a{i}", {"prompt_token_ids": [1, 2, 3 + i]}, long) for i in range(64)], "a")
        started = threading.Event()
        host.observer = type("O", (), {"step_done": lambda self, o, dt: started.set(), "step_failed": print})()
        assert started.wait(60)
        first = len(batches)
        b = host.submit_many([(f"b{i}", {"prompt_token_ids": [4, 5, 6 + i]}, short) for i in range(2)], "b")
        for future in b:
            assert len(future.result(timeout=60).outputs[0].token_ids) == 4
        with_b = [i for i, ids in enumerate(batches) if ids & {"b0", "b1"}]
        assert with_b[0] <= first + 2  # admitted at once (a step may have been under way)
        assert len(with_b) <= 4  # prefill + 3 decodes, never left out of a step
        assert all(not any(r.startswith("a") for r in batches[i]) for i in with_b)  # A paused meanwhile
        assert not any(f.done() for f in a)
        for future in a:
            assert len(future.result(timeout=300).outputs[0].token_ids) == 200  # A resumes and finishes
    finally:
        host.close()


def test_a_big_tenants_requests_step_in_rotating_windows_sized_by_measured_costs():
    fair = FairShare(capacity=256, reserve=16, step_factor=4)
    stepping = {"a": [f"a{i:03d}" for i in range(200)], "b": ["b0", "b1"]}
    assert fair.window() is None and fair.to_split(stepping) == set()  # nothing measured yet
    fair.stepped(0.002, paused=False, stepping=4)  # a small step: the fixed cost
    fair.stepped(0.102, paused=False, stepping=200)  # 0.5 ms per request more
    assert fair.window() == int(3 * 0.002 / 0.0005)  # (factor - 1) fixed costs of requests: 12
    windows = []
    for _ in range(20):
        sit_out = fair.to_split(stepping)
        assert {"b0", "b1"}.isdisjoint(sit_out)  # a small tenant steps whole, in the window
        windows.append(set(stepping["a"]) - sit_out)
    assert all(len(w) == 10 for w in windows)  # the window less B's two
    assert windows[0] == {f"a{i:03d}" for i in range(10)} and windows[1] == {f"a{i:03d}" for i in range(10, 20)}
    assert set().union(*windows) == set(stepping["a"])  # in turn, every request steps
    assert fair.to_split({"a": stepping["a"]}) == set()  # a tenant alone: nobody gains from its windows
    cheap = FairShare(capacity=256, reserve=16, step_factor=4)  # a GPU: more requests cost little more
    cheap.stepped(0.010, paused=False, stepping=4)
    cheap.stepped(0.012, paused=False, stepping=240)
    assert cheap.window() > 256 and cheap.to_split({"a": [f"a{i}" for i in range(240)], "b": ["b0"]}) == set()
    off = FairShare(step_factor=0)
    off.stepped(0.002, paused=False, stepping=4)
    off.stepped(0.102, paused=False, stepping=200)
    assert off.window() is None


def test_windows_bound_the_engines_batches_and_keep_the_outputs(tiny_model, monkeypatch):
    monkeypatch.setenv("PAGEDBATCH_FAIR_SHARE", "1")
    monkeypatch.setenv("PAGEDBATCH_FAIR_SLICE", "0")  # no pausing: the windows alone shape the steps
    path = str(tiny_model("qwen3"))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    requests = [(f"a{i}", {"prompt_token_ids": [1, 2, 3 + i]}, params) for i in range(32)]
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    newcomer = [("b0", {"prompt_token_ids": [4, 5, 6]}, long)]

    def run(window: int | None, others: list) -> tuple[dict, list[int]]:
        monkeypatch.setattr(FairShare, "window", lambda self: window)  # sizes fixed, not measured
        engine = LLMEngine(model=path, max_num_seqs=64)  # a tenant holding more than 16 is big
        sizes = []
        schedule = engine.scheduler.schedule

        def recording_schedule():
            batch = schedule()
            sizes.append(len(batch.seqs))
            return batch

        engine.scheduler.schedule = recording_schedule
        host = EngineHost(lambda: engine)
        try:
            futures = host.submit_many(others, "b") if others else []
            futures += host.submit_many(requests, "a")
            outputs = {f.result(timeout=120).request_id: f.result().outputs[0].token_ids for f in futures}
            return {rid: tokens for rid, tokens in outputs.items() if rid.startswith("a")}, sizes
        finally:
            host.close()

    whole, whole_sizes = run(None, newcomer)
    alone, alone_sizes = run(8, [])
    windowed, sizes = run(8, newcomer)
    assert max(whole_sizes) == 33 and max(alone_sizes) == 32  # no window, or a tenant alone: whole steps
    assert sizes[1:9] == [8] * 8  # beside B, while A holds more than 16 requests, each step holds one window
    assert max(sizes[1:]) <= 17  # once A holds no more than a quarter of the engine, its steps are whole
    assert windowed == whole == alone  # a request that sat steps out resumes with the same tokens


def test_only_big_steps_of_decodes_measure_a_requests_cost():
    """A step of prompts, or of a few requests, says little of what one more decoding request costs: measured
    from them (a prompt step right after a job's tail of small steps) the window had shrunk to 10 of 256."""
    fair = FairShare(capacity=256, reserve=16, step_factor=4)
    fair.stepped(0.002, paused=False, stepping=16)  # the fixed cost
    fair.stepped(0.200, paused=False, stepping=256, prompt_tokens=2_560)  # a step of prompts
    fair.stepped(0.010, paused=False, stepping=40)  # a step of a few requests
    shared = {"a": [f"a{i}" for i in range(255)], "b": ["b0"]}
    assert fair.window() is None and fair.to_split(shared) == set()
    fair.stepped(0.0048, paused=False, stepping=256)  # decodes: 2.8 ms for 256 requests beyond the fixed cost
    assert fair.window() == int(3 * 0.002 / (0.0028 / 256)) > 256
    assert fair.to_split(shared) == set()
