"""Varied inputs for the encoder tests and the embeddings benchmark: empty-ish, short, long (past a
model's max_seq_length), non-Latin scripts, digits and symbols; deterministic for a seed."""

from __future__ import annotations

import random

_EDGE = ["", " ", ".", "a", "?!", "\t\n", "🙂", "ok"]
_PIECES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the KV cache in blocks.",
    "日本語の文章を埋め込みます。",
    "今天天气很好，我们去公园散步吧。",
    "Привет, как дела? Всё хорошо.",
    "مرحبا بكم في عالم البرمجة",
    "नमस्ते, आप कैसे हैं?",
    "Γειά σου Κόσμε",
    "안녕하세요, 반갑습니다.",
    "שלום עולם",
    "Ça va très bien, merci beaucoup!",
    "Größe, Straße und Übermaß.",
    "3.14159 + 2.71828 = 5.85987",
    "e-mail: someone@example.com, url: https://example.org/path?q=1",
    "UPPER lower MiXeD CaSe",
    "Large language models generate text one token at a time.",
    "¿Dónde está la biblioteca?",
    "🙂🚀 emoji and text together 🎉",
    "<html><body>markup &amp; entities</body></html>",
]


def varied_texts(count: int, seed: int = 0, long_words: int = 400) -> list[str]:
    rng = random.Random(seed)
    out = list(_EDGE)
    while len(out) < count:
        kind = rng.random()
        if kind < 0.1:  # long: past 256 tokens
            out.append(" ".join(rng.choice(_PIECES) for _ in range(long_words // 8)))
        else:
            out.append(" ".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 6))))
    return out[:count]
