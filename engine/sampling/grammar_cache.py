"""Compiled grammars, one per distinct constraint per engine, built off the step's thread.

`GrammarCache.get(spec)` returns a future of xgrammar's `CompiledGrammar`: the first request
with a constraint starts its compilation on a small thread pool, later ones share the future.
The cache keeps the most recently used `max_entries` constraints (least recently used first out).
`check_spec` builds the tokenizer-independent grammar at request-check time, so a constraint
xgrammar cannot follow is refused with a clear error before it reaches the scheduler.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from engine.params.structured_params import StructuredOutputsParams


def choice_regex(choice: list[str]) -> str:
    """One alternative per choice, only regex syntax escaped (xgrammar warns on other escapes)."""
    return "(" + "|".join(re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", c) for c in choice) + ")"


_ANY_OBJECT = {"type": "object"}  # json_object: OpenAI's "a JSON object", any keys


COMPACT_SEPARATORS = (",", ":")


def _json_options(spec: StructuredOutputsParams, strict: bool = True) -> dict:
    """Compact JSON unless the request asked for any whitespace (`disable_any_whitespace=False`): a small
    model given free whitespace can spend its whole budget on it."""
    if spec.disable_any_whitespace is None:  # the default here: no whitespace at all
        return {"any_whitespace": False, "separators": COMPACT_SEPARATORS, "strict_mode": strict}
    if spec.disable_any_whitespace:  # vLLM's True: no free whitespace, xgrammar's separators (", " and ": ")
        return {"any_whitespace": False, "strict_mode": strict}
    return {"any_whitespace": True, "strict_mode": strict}


# JSON's unescaped characters as ranges of valid code points (no control characters, quote,
# backslash or surrogates). Spelled positively: xgrammar's byte automaton for a negated class also
# took overlong encodings (F0 80 80 80, E0 80 80), which no UTF-8 decoder accepts.
JSON_STRING_CHAR = "[ !#-\\[\\]-\ud7ff\ue000-\U0010ffff]"


def json_safe_strings(node):
    """The schema with each length-bounded string spelled as a pattern of JSON's unescaped
    characters: xgrammar's own grammar for minLength/maxLength lets raw control characters and
    UTF-8-encoded surrogates through, which JSON (and UTF-8) forbid. (Its grammar has no escapes
    either, so nothing is lost.)"""
    if isinstance(node, list):
        return [json_safe_strings(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: json_safe_strings(v) for k, v in node.items()}
    bounded = "minLength" in node or "maxLength" in node
    if node.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & node.keys():
        low, high = node.pop("minLength", 0), node.pop("maxLength", "")
        node["pattern"] = f"^{JSON_STRING_CHAR}{{{low},{high}}}$"
    return node


def _grammar(spec: StructuredOutputsParams) -> xgr.Grammar:
    kind = spec.kind
    if kind == "json":
        return xgr.Grammar.from_json_schema(json_safe_strings(spec.json), **_json_options(spec))
    if kind == "json_object":
        return xgr.Grammar.from_json_schema(_ANY_OBJECT, **_json_options(spec, strict=False))
    if kind == "regex":
        return xgr.Grammar.from_regex(spec.regex)
    if kind == "choice":
        return xgr.Grammar.from_regex(choice_regex(spec.choice))
    try:
        return xgr.Grammar.from_ebnf(spec.grammar)
    except Exception as ebnf_error:  # a Lark grammar is the other accepted form
        try:
            return xgr.Grammar.from_lark(spec.grammar)
        except Exception:
            raise ebnf_error from None


def check_spec(spec: StructuredOutputsParams) -> None:
    """Raise ValueError naming the problem when xgrammar cannot build the constraint."""
    try:
        _grammar(spec)
    except Exception as exc:  # xgrammar raises RuntimeError and others
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        # xgrammar's C++ errors start "[time] path/file.cc:line: "
        message = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0]) if lines else type(exc).__name__
        raise ValueError(f"structured_outputs.{spec.kind} cannot be compiled: {message[:500]}") from None


class GrammarCache:
    def __init__(
        self, tokenizer, vocab_size: int, stop_token_ids: list[int], *, max_entries: int = 256, threads: int = 2
    ):
        self._compiler_args = (tokenizer, vocab_size, stop_token_ids, threads)
        self._compiler: xgr.GrammarCompiler | None = None  # built by the first compilation, on the pool
        self._compiler_lock = threading.Lock()
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._entries: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.compilations = 0  # how many grammars were compiled (a cache miss each)

    def get(self, spec: StructuredOutputsParams) -> Future:
        key = spec.key()
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._entries[key] = future
            self.compilations += 1
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
            return future

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        """xgrammar's compiler over the tokenizer's vocabulary (reading a large vocabulary takes seconds)."""
        with self._compiler_lock:
            if self._compiler is None:
                tokenizer, vocab_size, stop_token_ids, threads = self._compiler_args
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
                )
                # xgrammar's own cache is off: ours bounds by entries and holds futures
                self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
            return self._compiler

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind = spec.kind
        if kind == "json":
            return self.compiler.compile_json_schema(json_safe_strings(spec.json), **_json_options(spec))
        return self.compiler.compile_grammar(_grammar(spec))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
