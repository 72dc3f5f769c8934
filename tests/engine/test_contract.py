"""The engine contract (engine.core.contract): LLMEngine satisfies it member by member, signature
by signature; the worker host refuses an engine that does not; and no module outside engine/ reaches
into an engine's private attributes or probes it with getattr/hasattr."""

from __future__ import annotations

import ast
import inspect

import pytest

from engine.core.contract import SequenceEngine, StepEngine, missing_members, require_step_engine
from engine.core.llm_engine import LLMEngine
from engine.params.sampling_params import SamplingParams
from tests.helpers import REPO
from tests.test_layout import modules
from workers.host.engine_host import EngineHost


def _members(contract: type) -> list[str]:
    return sorted(n for n in vars(contract) if not n.startswith("_"))


@pytest.mark.parametrize("contract", [StepEngine, SequenceEngine])
def test_llm_engine_has_every_method_of_the_contract_with_its_signature(contract):
    problems = []
    for name in _members(contract):
        ours, theirs = getattr(contract, name), getattr(LLMEngine, name, None)
        if theirs is None:
            problems.append(f"LLMEngine lacks {name}")
        elif isinstance(ours, property):
            if not isinstance(theirs, property):
                problems.append(f"{name}: a property in the contract, {type(theirs).__name__} on LLMEngine")
        elif callable(ours):
            want = [(p.name, p.kind, p.default) for p in inspect.signature(ours).parameters.values()]
            got = [(p.name, p.kind, p.default) for p in inspect.signature(theirs).parameters.values()]
            if want != got:
                problems.append(f"{name}: contract {want} != LLMEngine {got}")
    assert not problems, problems


def test_a_loaded_engine_is_a_step_engine_and_a_sequence_engine(tiny_model):
    engine = LLMEngine(model=str(tiny_model("qwen3")), max_num_seqs=4, scheduling_policy="priority")
    assert isinstance(engine, StepEngine) and isinstance(engine, SequenceEngine)
    assert missing_members(engine, SequenceEngine) == []
    assert (engine.max_num_seqs, engine.takes_priority) == (4, True)
    assert engine.block_size == engine.config.block_size
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3, 4, 5]}, SamplingParams(max_tokens=2, temperature=0))
    engine.step()
    load = engine.load()
    assert (load.running, load.waiting) == (1, 0)
    assert load.blocks_free == engine.num_free_blocks() < load.blocks_total
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.load().blocks_free == load.blocks_total
    assert engine.num_pending_imports() == 0 and engine.kv_transfer_stats()["imported"] == 0


def test_the_host_refuses_an_engine_that_breaks_the_contract():
    class HalfAnEngine:
        def step(self):
            return []

    with pytest.raises(TypeError, match=r"HalfAnEngine is not a StepEngine .*lacks .*add_request.*max_num_seqs"):
        EngineHost(HalfAnEngine)
    with pytest.raises(TypeError, match="takes_priority"):
        require_step_engine(HalfAnEngine())


ENGINEISH = ("engine", "llm_engine", "eng")  # names the code gives an engine (x.engine, self.llm_engine, ...)


def _names_an_engine(node: ast.expr) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name.lstrip("_") in ENGINEISH


def _private(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and _names_an_engine(node.value)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    )


def _probe(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr")
        and bool(node.args)
        and _names_an_engine(node.args[0])
    )


def _reaches(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if _private(node):
            found.append((node.lineno, f"{ast.unparse(node)}: a private member"))
        if _probe(node):
            found.append((node.lineno, f"{ast.unparse(node)}: a probe; the contract says what an engine has"))
    return found


def test_nothing_outside_the_engine_touches_an_engine_private_or_probes_it():
    problems = [
        f"{rel}:{line} {what}"
        for name, rel in modules().items()
        if not name.startswith("engine")
        for line, what in _reaches(ast.parse((REPO / rel).read_text()))
    ]
    assert not problems, "\n".join(problems)


def test_the_check_sees_a_private_reach_and_a_probe():
    code = "def f(host):\n    host.engine._lock\n    getattr(host.engine, 'pause_requests')\n    host._engine_ok\n"
    assert [line for line, _ in _reaches(ast.parse(code))] == [2, 3]


def test_the_workers_use_only_the_contract():
    """In workers/, `engine` is always ours: every member read on one is a `StepEngine` member."""
    allowed = set(_members(StepEngine)) | {n for c in StepEngine.__mro__ for n in vars(c).get("__annotations__", {})}
    problems = []
    for name, rel in modules().items():
        if not name.startswith("workers"):
            continue
        for node in ast.walk(ast.parse((REPO / rel).read_text())):
            if isinstance(node, ast.Attribute) and _names_an_engine(node.value) and node.attr not in allowed:
                problems.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert not problems, "members outside engine.core.contract.StepEngine:\n" + "\n".join(problems)
