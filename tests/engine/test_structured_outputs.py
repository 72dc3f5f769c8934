"""Structured outputs in the engine on tiny random-weight models (garbage when unconstrained):
every constrained output parses and validates, the masks equal xgrammar's own matcher's, and
bad constraints are refused when the request is checked."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import xgrammar as xgr

import engine.sampling.sampler
from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.sampling.grammar_cache import json_safe_strings
from engine.sampling.structured_outputs import apply_grammar_bitmask
from engine.testing.tiny import write_tiny_model
from tests.helpers import assert_pool_free

PROMPTS = [
    "Hello, world!",
    "The quick brown fox",
    "0123",
    "Paged attention stores the key value cache",
    "How are you today?",
    "{",
    "Batch inference jobs are uploaded as JSONL files",
]


def _leaf(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum", "null_or_int", "array", "const"]
    if depth < 2:
        kinds += ["object", "object"]
    kind = rng.choice(kinds)
    if kind == "string":
        low = rng.randint(0, 3)
        schema = {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 8)}
        if rng.random() < 0.3:
            schema = {"type": "string", "pattern": rng.choice([r"^[a-z]{2,5}$", r"^\d{3}-\d{2}$", r"^(ab|cd)+$"])}
        return schema
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": rng.choice([1, 10, 1e6])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, None, True, "a b"], rng.randint(1, 4))}
    if kind == "null_or_int":
        return {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 9}]}
    if kind == "const":
        return {"const": rng.choice(["fixed", 7, False])}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": _leaf(rng, depth + 1), "minItems": low, "maxItems": low + rng.randint(0, 2)}
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(["id", "name", "age", "score", "tags", "ok", "kind", "meta", "x", "when"], rng.randint(1, 4))
    props = {name: _leaf(rng, depth) for name in names}
    required = [n for n in names if rng.random() < 0.6]  # the others are optional
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def varied_schemas(count: int, seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    schemas = [_object(rng, 0) for _ in range(count - 4)]
    schemas += [  # top-level non-objects too
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
        {"enum": ["alpha", "beta", "gamma"]},
        {
            "type": "object",
            "properties": {"p": {"$ref": "#/$defs/point"}, "q": {"$ref": "#/$defs/point"}},
            "required": ["p"],
            "$defs": {
                "point": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": 0, "maximum": 9},
                        "y": {"type": "integer", "minimum": 0, "maximum": 9},
                    },
                    "required": ["x", "y"],
                    "additionalProperties": False,
                }
            },
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "list": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"k": {"type": "string", "maxLength": 4}},
                        "required": ["k"],
                    },
                    "maxItems": 3,
                }
            },
            "required": ["list"],
        },
    ]
    return schemas


def engine_with_pressure(model_dir, **kw) -> LLM:
    """Chunked prefill (16-token budget) and a pool small enough to preempt."""
    kw = {
        "num_kv_blocks": 40,
        "block_size": 16,
        "max_num_batched_tokens": 16,
        "max_num_seqs": 24,
        "enable_prefix_caching": True,
        **kw,
    }
    return LLM(str(model_dir), device="cpu", dtype="float32", seed=0, **kw)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param) / "model", arch=request.param, seed=3)


@pytest.fixture(scope="module")
def llm(model_dir):
    return engine_with_pressure(model_dir)


def _params(i: int, **spec) -> SamplingParams:
    compact = None if i % 2 == 0 else False  # half compact (the default), half with free whitespace (vLLM's)
    return SamplingParams(
        temperature=1.0,
        seed=i,
        max_tokens=400,
        n=2 if i % 9 == 0 else 1,
        structured_outputs=StructuredOutputsParams(disable_any_whitespace=compact, **spec),
    )


def test_every_output_validates_against_its_schema(llm):
    schemas = varied_schemas(52)
    prompts = [PROMPTS[i % len(PROMPTS)] * (1 + i % 3) for i in range(len(schemas))]
    outputs = llm.generate(prompts, [_params(i, json=s) for i, s in enumerate(schemas)], use_tqdm=False)
    assert llm.llm_engine.stats["preemptions"] > 0, "the run was meant to preempt"
    checked = 0
    for schema, out in zip(schemas, outputs):
        for c in out.outputs:
            assert c.finish_reason == "stop", (schema, c.text)
            jsonschema.validate(json.loads(c.text), schema)
            checked += 1
    assert checked > len(schemas)  # n=2 requests gave two each
    assert_pool_free(llm.llm_engine)


def test_unconstrained_output_is_garbage(llm):
    """The check above means something: the same model unconstrained does not write JSON."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=1, max_tokens=40), use_tqdm=False)
    parsed = 0
    for out in outs:
        try:
            json.loads(out.outputs[0].text)
            parsed += 1
        except ValueError:
            pass
    assert parsed == 0


def test_choice_regex_and_json_object(llm):
    choices = ["yes", "no", "not sure", "¿quizás?"]
    regexes = [r"\d{3}-[a-z]{2,4}", r"(cat|dog)s? [0-9]+", r"[A-Z][a-z]{1,6}@example\.(com|org)", r"(ab)*c"]
    params = [_params(i, choice=choices) for i in range(8)]
    params += [_params(i, regex=regexes[i % len(regexes)]) for i in range(8)]
    params += [_params(i, json_object=True) for i in range(4)]
    params[-1].max_tokens = params[-2].max_tokens = 600
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params, use_tqdm=False)
    for i, out in enumerate(outs):
        for c in out.outputs:
            if i < 8:
                assert c.text in choices
            elif i < 16:
                assert re.fullmatch(regexes[(i - 8) % len(regexes)], c.text), c.text
            elif c.finish_reason == "stop":  # any JSON can run long; whatever ended must be an object
                assert isinstance(json.loads(c.text), dict)
            assert c.finish_reason == "stop" or i >= 16, c.text


def test_greedy_grammar(llm):
    """An EBNF grammar, greedy: the same output every time, and it matches the grammar."""
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "[" [0-9] "]"'
    p = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(grammar=grammar))
    a, b = (llm.generate("Hello", p, use_tqdm=False)[0].outputs[0] for _ in range(2))
    assert a.text == b.text and a.finish_reason == "stop"
    assert re.fullmatch(r"\((?:[a-c]|\[[0-9]\])(?:,(?:[a-c]|\[[0-9]\]))*\)", a.text)


def test_masks_equal_xgrammars_own_matcher(model_dir, monkeypatch):
    """Each step's allowed tokens, as the sampler saw them, equal those of an independent
    xgrammar matcher fed the same tokens (the EOS ids as its stop tokens)."""
    llm = engine_with_pressure(model_dir, max_num_batched_tokens=32)
    eng = llm.llm_engine
    seen: dict[tuple[str, int, int], set[int]] = {}

    def recording(logits, seqs):
        out = apply_grammar_bitmask(logits, seqs)
        for row, seq in enumerate(seqs):
            if seq.grammar is not None:
                allowed = (out[row] > float("-inf")).nonzero().flatten().tolist()
                seen[(seq.request_id, seq.index, seq.num_output_tokens)] = set(allowed)
        return out

    monkeypatch.setattr(engine.sampling.sampler, "apply_grammar_bitmask", recording)
    schemas = varied_schemas(6, seed=11)
    specs = [StructuredOutputsParams(json=s) for s in schemas] + [StructuredOutputsParams(regex=r"[a-f]{2}\d+x")]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=300, structured_outputs=s) for i, s in enumerate(specs)
    ]
    outs = llm.generate(PROMPTS[: len(params)], params, use_tqdm=False)

    info = xgr.TokenizerInfo.from_huggingface(
        eng.tokenizer, vocab_size=eng.model_config.vocab_size, stop_token_ids=eng.eos_token_ids
    )
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    steps = 0
    for spec, out in zip(specs, outs):
        # the engine's schema: length-bounded strings spelled as JSON-safe patterns; compact, its default
        compiled = (
            compiler.compile_json_schema(json_safe_strings(spec.json), any_whitespace=False, separators=(",", ":"))
            if spec.json is not None
            else compiler.compile_regex(spec.regex)
        )
        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, eng.model_config.vocab_size)
        for step, token in enumerate(out.outputs[0].token_ids):
            matcher.fill_next_token_bitmask(mask)
            expected = {t for t in range(eng.model_config.vocab_size) if (mask[0, t // 32] >> (t % 32)) & 1}
            assert seen[(out.request_id, 0, step)] == expected, (out.request_id, step)
            assert token in expected
            assert matcher.accept_token(token)
            steps += 1
        assert matcher.is_terminated()  # it ended on an EOS the grammar allowed
    assert steps > 50


def test_same_constraint_compiles_once_and_the_cache_is_bounded(model_dir):
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=32, grammar_cache_size=2)
    cache = llm.llm_engine.structured.cache
    spec = {"choice": ["a", "b"]}
    llm.generate(["Hi"] * 3, SamplingParams(max_tokens=4, structured_outputs=spec), use_tqdm=False)
    assert cache.compilations == 1
    for pattern in ("x+", "y+", "z+"):
        llm.generate("Hi", SamplingParams(max_tokens=4, structured_outputs={"regex": pattern}), use_tqdm=False)
    assert len(cache) == 2 and cache.compilations == 4


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"json": {"type": "objekt"}}, "type 'objekt'"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": {"type": "array", "minItems": 3, "maxItems": 1}}, "minItems (3) exceeds maxItems"),
        ({"regex": "(unclosed"}, "not a valid regular expression"),
        ({"choice": []}, "non-empty list"),
        ({"json_object": True, "regex": "a"}, "exactly one kind"),
        ({}, "exactly one kind"),
    ],
)
def test_bad_constraints_are_refused_by_sampling_params(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(structured_outputs=spec)


def test_constraints_xgrammar_cannot_build_are_refused_at_request_check(llm):
    eng = llm.llm_engine
    for spec, message in (
        ({"json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}, "nope"),
        ({"grammar": "root ::= undefined_rule"}, "grammar cannot be compiled"),
    ):
        with pytest.raises(ValueError, match=message):
            eng.add_request("bad", "Hello", SamplingParams(structured_outputs=spec))
    assert not eng.has_unfinished_requests()


def test_length_bounded_strings_exclude_control_characters():
    """xgrammar's own maxLength grammar lets raw control characters through; ours does not."""
    schema = json_safe_strings({"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}})
    pattern = re.compile(schema["properties"]["s"]["pattern"])
    assert pattern.match("abc") and pattern.match("é") and pattern.match("")
    assert not any(pattern.match(s) for s in ("abcd", "a\x15", 'a"', "a\\"))


@pytest.mark.parametrize(
    ("raw", "accepted"),
    [
        ('"a\U0001f600"'.encode(), True),
        ('"\U0010ffff"'.encode(), True),
        ('"\ud7ff\ue000é"'.encode(), True),
        (b'"[]#!"', True),
        (b'"a\xf0\x80\x80\x80"', False),  # overlong 4-byte encoding: decodes as four U+FFFD (seen once in CI)
        (b'"a\xe0\x80\x80"', False),  # overlong 3-byte
        (b'"a\xed\xa0\x80"', False),  # a UTF-8-encoded surrogate
        (b'"a\xf4\x90\x80\x80"', False),
        (b'"a\xf5\x80\x80\x80"', False),  # past U+10FFFF
        (b'"a\x80"', False),
        (b'"a\x15"', False),
        (b'"a\\""', False),
    ],
)
def test_length_bounded_strings_take_only_valid_utf8_at_the_byte_level(raw, accepted):
    """xgrammar's automaton for a negated character class let overlong encodings through, so a
    model's bytes could satisfy maxLength and decode as U+FFFD; the engine's pattern must not."""
    schema = json_safe_strings(
        {"type": "object", "properties": {"s": {"type": "string", "maxLength": 6}}, "required": ["s"]}
    )
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    assert xgr.testing._is_grammar_accept_string(grammar, b'{"s": ' + raw + b"}") is accepted


def test_structured_outputs_round_trip_through_a_dict():
    spec = StructuredOutputsParams(json={"type": "integer"}, disable_any_whitespace=True)
    again = SamplingParams(structured_outputs=spec.to_dict()).structured_outputs
    assert again == spec and again.key() == spec.key()


def test_a_compiling_grammar_holds_back_only_its_own_request(model_dir, monkeypatch):
    """Compilation runs off the step: while a grammar compiles, other requests run and finish,
    and the constrained request waits in the queue, then runs once its grammar is ready."""
    import threading

    from engine.sampling.grammar_cache import GrammarCache

    release = threading.Event()
    compile_for_real = GrammarCache._compile

    def slow_compile(self, spec):
        assert release.wait(60)
        return compile_for_real(self, spec)

    monkeypatch.setattr(GrammarCache, "_compile", slow_compile)
    eng = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=32).llm_engine
    eng.add_request("constrained", "Hello", SamplingParams(max_tokens=20, structured_outputs={"choice": ["yes", "no"]}))
    eng.add_request("free", "Hello", SamplingParams(max_tokens=4, ignore_eos=True))
    done = {}
    for _ in range(10):
        done.update({o.request_id: o for o in eng.step()})
    assert "free" in done and "constrained" not in done
    assert not any(s.request_id == "constrained" for s in eng.scheduler.running + list(eng.scheduler.waiting))
    release.set()
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step()})
    assert done["constrained"].outputs[0].text in ("yes", "no")
