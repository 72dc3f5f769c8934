"""A model directory's tokenizer without transformers (and so without torch): `tokenizer.json` through the
`tokenizers` library, the special tokens and chat template from `tokenizer_config.json` (or
`chat_template.jinja` / `chat_template.json`), the template rendered by `engine.hf.jinja_chat`.

It offers the part of a Hugging Face fast tokenizer that validation and logprobs use (`backend_tokenizer`,
`decode`, `convert_tokens_to_ids`, `convert_ids_to_tokens`, the special tokens, `apply_chat_template` with
tokenize=False, pairs for cross-encoders). `load` answers None where transformers would build the tokenizer
differently from the file (no tokenizer.json, bos/eos switches that rewrite the post-processor, special
tokens missing from the vocabulary, cleanup of spaces): the caller then loads transformers' own.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace

from engine.hf import jinja_chat

NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json keys that make transformers change the tokenizer it reads from tokenizer.json
_REWRITES = (
    "add_bos_token",
    "add_eos_token",
    "add_prefix_space",
    "do_lower_case",
    "strip_accents",
    "tokenize_chinese_chars",
    "legacy",
    "from_slow",
)
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _content(token) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _chat_template(root: Path, config: dict):
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    as_json = root / "chat_template.json"
    if as_json.is_file():
        return json.loads(as_json.read_text(encoding="utf-8")).get("chat_template")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates
        return {t["name"]: t["template"] for t in template}
    return template


def load(model_dir: str | Path) -> LightTokenizer | None:
    """The directory's tokenizer, or None where only transformers builds it faithfully."""
    from tokenizers import Tokenizer

    root = Path(model_dir)
    if not (root / "tokenizer.json").is_file() or not (root / "tokenizer_config.json").is_file():
        return None
    config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
    if config.get("tokenizer_class", _GENERIC_CLASSES[0]) not in _GENERIC_CLASSES:
        return None
    if any(k in config for k in _REWRITES) or config.get("clean_up_tokenization_spaces"):
        return None
    backend = Tokenizer.from_file(str(root / "tokenizer.json"))
    named = {k: _content(config.get(k)) for k in NAMED_SPECIAL if _content(config.get(k)) is not None}
    extra = [_content(t) for t in config.get("extra_special_tokens") or config.get("additional_special_tokens") or []]
    if isinstance(config.get("extra_special_tokens"), dict):
        return None  # named extra tokens: transformers' attributes, not modelled here
    if any(backend.token_to_id(t) is None for t in [*named.values(), *extra]):
        return None  # transformers would add them to the vocabulary
    return LightTokenizer(
        backend,
        named,
        [t for t in extra if t],
        _chat_template(root, config),
        config.get("model_input_names"),
        str(root),
    )


class Encoded(dict):
    """`input_ids` (and `token_type_ids`) as keys and as attributes, like transformers' BatchEncoding."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class LightTokenizer:
    is_fast = True

    def __init__(
        self,
        backend,
        special_tokens: Mapping[str, str],
        extra_special: list[str],
        chat_template,
        model_input_names: list[str] | None,
        name_or_path: str = "",
    ):
        self.name_or_path = name_or_path
        self.backend_tokenizer = backend
        self.special_tokens_map = dict(special_tokens)
        self.chat_template = chat_template
        self._extra = extra_special
        self._names = model_input_names
        self.added_tokens_decoder = {
            id_: SimpleNamespace(content=t.content, special=t.special)
            for id_, t in backend.get_added_tokens_decoder().items()
        }

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self._extra]))

    @functools.cached_property
    def all_special_ids(self) -> list[int]:
        return [self.backend_tokenizer.token_to_id(t) for t in self.all_special_tokens]

    def __call__(self, text, add_special_tokens: bool = True) -> Encoded:
        """`tokenizer(text)` / `tokenizer([texts])`: {"input_ids": ...}."""
        if isinstance(text, str):
            return Encoded(input_ids=self.encode(text, add_special_tokens=add_special_tokens))
        encodings = self.backend_tokenizer.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return Encoded(input_ids=[e.ids for e in encodings])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.backend_tokenizer.token_to_id(token)

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self.backend_tokenizer.id_to_token(token_id)

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, conversations, tools=None, documents=None, add_generation_prompt=False, tokenize=True, **kwargs
    ):
        """transformers' rendering (tokenize=False only); a list of conversations gives a list of texts."""
        if tokenize:
            raise NotImplementedError("render with tokenize=False, then encode")
        batched = bool(conversations) and isinstance(conversations[0], (list, tuple))
        texts = jinja_chat.render(
            self.chat_template,
            conversations if batched else [conversations],
            self.special_tokens_map,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        return texts if batched else texts[0]

    def encode_pairs(self, firsts: list[str], seconds: list[str] | None, max_length: int | None = None) -> dict:
        """Cross-encoder inputs as transformers' `tokenizer(firsts, seconds, truncation=..., max_length=...)`:
        `input_ids`, and `token_type_ids` where the model takes them."""
        backend = self.backend_tokenizer if max_length is None else self._truncating(max_length)
        inputs = list(zip(firsts, seconds)) if seconds is not None else list(firsts)
        encodings = backend.encode_batch(inputs, add_special_tokens=True)
        out = Encoded(input_ids=[e.ids for e in encodings])
        if "token_type_ids" in (self._names or ()):
            out["token_type_ids"] = [e.type_ids for e in encodings]
        return out

    @functools.lru_cache(maxsize=4)  # noqa: B019 - a few lengths per tokenizer, kept with it
    def _truncating(self, max_length: int):
        from tokenizers import Tokenizer

        copy = Tokenizer.from_str(self.backend_tokenizer.to_str())
        copy.enable_truncation(max_length, strategy="longest_first")
        return copy
