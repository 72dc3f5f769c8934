"""Logprobs in the OpenAI bodies against the engine's real outputs on a byte-level tiny model (which
samples lone UTF-8 bytes all the time): tokens' real bytes and own text, pieces that join into the text, and
completions `top_logprobs` with k distinct entries plus the sampled token."""

from __future__ import annotations

import pytest

from batchfile.endpoints.responses import chat_completion_body, text_completion_body
from batchfile.token_text import _unicode_to_byte, text_pieces, token_bytes, token_label
from engine.entrypoints.llm import LLM
from engine.params.sampling_params import SamplingParams

openai_types = pytest.importorskip("openai.types")
chat_types = pytest.importorskip("openai.types.chat")

K = 3


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model("qwen3")), device="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def outputs(llm):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=24, logprobs=K, ignore_eos=True)
    prompts = ["The weather is 20°C", "Ünïcödé text:", "hello world", "<|im_start|>user"]
    return llm.generate(prompts, params, use_tqdm=False)


def _byte_id(tokenizer, byte: int) -> int:
    char = next(c for c, b in _unicode_to_byte().items() if b == byte)
    return tokenizer.convert_tokens_to_ids(char)


def test_byte_tokens_have_their_real_bytes(llm):
    tok = llm.get_tokenizer()
    assert token_bytes(tok, _byte_id(tok, 0xB0)) == bytes([176])  # it was the UTF-8 of U+FFFD
    assert token_label(tok, _byte_id(tok, 0xB0)) == "bytes:\\xb0"
    for text in ("20°C", "Ünïcödé", " hello world", "日本"):
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(token_bytes(tok, t) for t in ids) == text.encode()
    special = tok.convert_tokens_to_ids("<|im_end|>")
    assert token_bytes(tok, special) == b"<|im_end|>"


def test_every_vocabulary_token_decodes_to_its_bytes(llm):
    tok = llm.get_tokenizer()
    specials = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    for token_id in range(tok.vocab_size):
        if token_id in specials:
            continue
        raw = token_bytes(tok, token_id)
        assert raw.decode("utf-8", "replace") == tok.decode([token_id]), token_id


def test_byte_fallback_pieces_of_sentencepiece_vocabularies():
    class SentencePieceLike:
        all_special_ids: list[int] = []
        pieces = {0: "<0xB0>", 1: "▁hello", 2: "é"}

        def convert_ids_to_tokens(self, token_id):
            return self.pieces[token_id]

    tok = SentencePieceLike()
    assert [token_bytes(tok, t) for t in range(3)] == [b"\xb0", b" hello", "é".encode()]


def test_pieces_join_into_the_text_with_specials_and_split_characters(llm):
    tok = llm.get_tokenizer()
    special = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("a°b", add_special_tokens=False) + [special] + tok.encode(" 日本 end", add_special_tokens=False)
    for skip in (True, False):
        text = tok.decode(ids, skip_special_tokens=skip)
        pieces = text_pieces(tok, ids, text, skip_special_tokens=skip)
        assert len(pieces) == len(ids) and "".join(pieces) == text
    text = tok.decode(ids, skip_special_tokens=True)
    assert "".join(text_pieces(tok, ids, text[:3])) == text[:3]  # a stop string cut the text short


def test_chat_logprobs_bytes_and_tokens(llm, outputs):
    tok = llm.get_tokenizer()
    specials = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    lone_bytes = 0
    for output in outputs:
        body = chat_completion_body(output, model="tiny", logprobs=K, tokenizer=tok)
        chat_types.ChatCompletion.model_validate(body)
        (choice,) = body["choices"]
        content = choice["logprobs"]["content"]
        ids = list(output.outputs[0].token_ids)
        assert len(content) == len(ids)
        for entry, token_id in zip(content, ids):  # each token's own text, the string it has in top_logprobs too
            assert entry["token"] == token_label(tok, token_id)
            same = [t["token"] for t in entry["top_logprobs"] if bytes(t["bytes"]) == token_bytes(tok, token_id)]
            assert all(t == entry["token"] for t in same)
            if token_id not in specials and not entry["token"].startswith("bytes:"):
                assert entry["token"] == tok.decode([token_id])  # vLLM's decoded_token, OpenAI's token
        joined = b"".join(bytes(t["bytes"]) for t, i in zip(content, ids) if i not in specials)
        assert joined.decode("utf-8", "replace") == tok.decode(ids, skip_special_tokens=True)
        for entry, token_id in zip(content, ids):
            assert bytes(entry["bytes"]) == token_bytes(tok, token_id)
            assert len(entry["top_logprobs"]) == K
            lone_bytes += len(entry["bytes"]) == 1 and entry["bytes"][0] >= 0x80
    assert lone_bytes > 0  # the check above saw byte tokens


def test_completion_top_logprobs_and_offsets(llm, outputs):
    tok = llm.get_tokenizer()
    for output in outputs:
        body = text_completion_body(output, model="tiny", logprobs=K, tokenizer=tok)
        openai_types.Completion.model_validate(body)
        (choice,) = body["choices"]
        lp = choice["logprobs"]
        engine = output.outputs[0]
        assert lp["tokens"] == [token_label(tok, t) for t in engine.token_ids]  # each token's own text
        pieces = text_pieces(tok, list(engine.token_ids), choice["text"])
        offset = 0
        for i, (token, start) in enumerate(zip(lp["tokens"], lp["text_offset"])):
            assert start == offset and choice["text"][start : start + len(pieces[i])] == pieces[i]
            offset += len(pieces[i])
            assert token in lp["top_logprobs"][i] or f"token_id:{engine.token_ids[i]}" in lp["top_logprobs"][i]
            top, sampled = engine.logprobs[i], engine.token_ids[i]
            best = sorted(top, key=lambda t: -top[t].logprob)[:K]
            expected = set(best) | {sampled}
            assert len(lp["top_logprobs"][i]) == len(expected) >= K  # k entries, plus the sampled token
            assert lp["token_logprobs"][i] in lp["top_logprobs"][i].values()
