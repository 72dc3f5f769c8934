"""sentence-transformers' `max_seq_length` below the model's position limit: as vLLM, it is the
context (the engine's, the batch validator's and the worker registry's); an input within it embeds
as sentence-transformers does; a longer one is an error (sentence-transformers silently truncates)
unless truncation is asked, and then it is cut as sentence-transformers cuts it (the tokenizer's
closing EOS kept)."""

from __future__ import annotations

import io
import json

import pytest

from engine import LLM, PoolingParams
from engine.hf.model_info import context_length, read_config
from engine.params.pooling_truncation import cut
from engine.testing.tiny_embedding import write_tiny_embedding_model
from tests.engine.test_embeddings import assert_close, cosines, embed, st_encode

MAX_SEQ = 40
SHORT = ["hello world", "the quick brown fox jumps over the lazy dog", "paged attention " * 6]
LONG = ["paged attention stores the key value cache in fixed size blocks " * 6, "hello world " * 30]


@pytest.fixture(scope="module", params=["last", "mean"])
def model(request, tmp_path_factory):
    """A tiny model whose positions reach 128 but whose sentence-transformers limit is 40, with a
    tokenizer that closes every text with EOS (as Qwen3-Embedding's: last-token pooling reads it)."""
    path = tmp_path_factory.mktemp(f"maxseq-{request.param}") / "m"
    return write_tiny_embedding_model(
        path, "qwen3", request.param, max_seq_length=MAX_SEQ, closing_eos=True, max_position_embeddings=128
    )


def test_max_seq_length_is_the_context_everywhere(model):
    from batchfile.model_limits import ModelLimits

    assert context_length(read_config(model)) == MAX_SEQ
    assert ModelLimits.from_dir(model).max_model_len == MAX_SEQ
    assert LLM(str(model), num_kv_blocks=16).llm_engine.max_model_len == MAX_SEQ
    assert LLM(str(model), num_kv_blocks=16, max_model_len=32).llm_engine.max_model_len == 32
    with pytest.raises(
        ValueError,
        match=r"max_model_len=64 exceeds the model's context length 40 "
        r"\(sentence-transformers' max_seq_length\)",
    ):
        LLM(str(model), num_kv_blocks=16, max_model_len=64)
    assert context_length({"max_position_embeddings": 128, "sentence_transformers_max_seq_length": 512}) == 128
    with pytest.raises(ValueError, match="max_seq_length must be a positive integer"):
        context_length({"max_position_embeddings": 128, "sentence_transformers_max_seq_length": 0})


def test_inputs_within_max_seq_length_equal_sentence_transformers(model):
    llm = LLM(str(model), num_kv_blocks=64)
    outs = llm.embed(SHORT, use_tqdm=False)
    assert all(o.prompt_token_ids[-1] == llm.llm_engine.tokenizer.eos_token_id for o in outs)
    assert max(len(o.prompt_token_ids) for o in outs) > 20
    assert_close([o.outputs.embedding for o in outs], st_encode(model, SHORT))


def test_longer_inputs_are_refused_or_cut_as_sentence_transformers_cuts(model):
    llm = LLM(str(model), num_kv_blocks=64)
    tokenizer = llm.llm_engine.tokenizer
    assert all(len(tokenizer(t).input_ids) > MAX_SEQ for t in LONG)
    with pytest.raises(ValueError, match="prompt 1: the input has .* tokens, more than the model's context of 40"):
        llm.embed(SHORT[:1] + LONG, use_tqdm=False)
    expected = st_encode(model, LONG)  # sentence-transformers truncates to max_seq_length, silently
    for kwargs in (
        {"truncate_prompt_tokens": -1},
        {"tokenization_kwargs": {"truncation": True}},
        {"pooling_params": PoolingParams(truncate_prompt_tokens=MAX_SEQ)},
    ):
        outs = llm.embed(LONG, use_tqdm=False, **kwargs)
        assert [o.prompt_token_ids for o in outs] == [
            tokenizer(t, truncation=True, max_length=MAX_SEQ).input_ids for t in LONG
        ]
        assert_close([o.outputs.embedding for o in outs], expected)
    # the last tokens instead (the EOS still closes the text): not sentence-transformers' vector
    (left,) = llm.embed(
        LONG[:1], use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 20, "truncation_side": "left"}
    )
    plain = tokenizer(LONG[0], add_special_tokens=False).input_ids
    assert left.prompt_token_ids == plain[-19:] + [tokenizer.eos_token_id]
    assert cosines([left.outputs.embedding], expected[:1])[0] < 0.999
    # token ids given as such are cut as they are
    ids = list(range(10, 80))
    (given,) = embed(llm, [{"prompt_token_ids": ids}], truncate_prompt_tokens=-1)
    assert_close([given], embed(llm, [{"prompt_token_ids": ids[:MAX_SEQ]}]))


def test_bad_truncation_arguments_are_clear_errors(model):
    llm = LLM(str(model), num_kv_blocks=16)
    for kwargs, message in (
        ({"padding": "max_length"}, r"tokenization_kwargs \['padding'\] are not supported"),
        ({"max_length": 5}, "max_length needs truncation=True"),
        ({"truncation": "only_second"}, "truncation='only_second' is not supported"),
        ({"truncation_side": "middle"}, "truncation_side must be 'left' or 'right'"),
        ({"truncate_prompt_tokens": 41}, "truncate_prompt_tokens=41 exceeds the model's context"),
    ):
        with pytest.raises(ValueError, match=message):
            llm.embed(LONG, use_tqdm=False, tokenization_kwargs=kwargs)
    with pytest.raises(ValueError, match="no room for the text beside the tokenizer's 1 special tokens"):
        llm.embed(LONG, use_tqdm=False, truncate_prompt_tokens=1)


def test_cut_keeps_special_tokens_around_the_content():
    assert cut([1, 5, 6, 7, 8, 2], 4, "right", [5, 6, 7, 8]) == [1, 5, 6, 2]
    assert cut([1, 5, 6, 7, 8, 2], 4, "left", [5, 6, 7, 8]) == [1, 7, 8, 2]
    assert cut([5, 6, 7, 8], 2, "right", [5, 6, 7, 8]) == [5, 6]
    assert cut([5, 6, 7, 8], 2, "left", None) == [7, 8]
    assert cut([5, 6], 4, "right", [5, 6]) == [5, 6]


def test_batch_lines_longer_than_max_seq_length(model):
    """A line's input past max_seq_length is that line's `context_length_exceeded` error; with
    truncation asked it runs the tokens `LLM.embed` would, whose vector is sentence-transformers'."""
    from batchfile.model_limits import ModelLimits
    from batchfile.shard_input import BadLine, decode_request, validate_stream

    def line(cid, **body):
        return {"custom_id": cid, "method": "POST", "url": "/v1/embeddings", "body": {"model": "emb", **body}}

    lines = [
        line("short", input=SHORT),
        line("long", input=["hi", LONG[0]]),
        line("cut", input=LONG, truncate_prompt_tokens=-1),
        line("left", input=LONG[0], truncate_prompt_tokens=20, truncation_side="left"),
        line("ids", input=[list(range(10, 80))]),
        line("too_far", input=LONG[0], truncate_prompt_tokens=MAX_SEQ + 1),
    ]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    items = list(validate_stream(io.BytesIO(data), {"emb": ModelLimits.from_dir(model, name="emb")}))
    errors = {
        lines[i]["custom_id"]: (it.error.code, it.error.message)
        for i, it in enumerate(items)
        if isinstance(it, BadLine)
    }
    assert sorted(errors) == ["ids", "long", "too_far"]
    assert errors["long"][0] == errors["ids"][0] == "context_length_exceeded"
    assert "input[1] is" in errors["long"][1] and "context length is 40" in errors["long"][1]
    assert errors["too_far"] == ("invalid_parameter", "truncate_prompt_tokens=41 exceeds the model's context of 40")
    ran = {
        r.custom_id: r.inputs for r in (decode_request(it.shard_line) for it in items if not isinstance(it, BadLine))
    }
    llm = LLM(str(model), num_kv_blocks=64)
    assert ran["cut"] == [o.prompt_token_ids for o in llm.embed(LONG, use_tqdm=False, truncate_prompt_tokens=-1)]
    assert ran["left"] == [
        o.prompt_token_ids
        for o in llm.embed(
            LONG[:1], use_tqdm=False, pooling_params=PoolingParams(truncate_prompt_tokens=20, truncation_side="left")
        )
    ]
    assert_close(embed(llm, [{"prompt_token_ids": ids} for ids in ran["cut"]]), st_encode(model, LONG))


def test_do_lower_case_lowercases_texts_as_sentence_transformers(tmp_path):
    """`do_lower_case` in sentence_bert_config.json: texts (after the default prompt) are lowercased
    before tokenizing, by `LLM.embed` and the batch validator alike; token ids stay as given."""
    from batchfile.model_limits import ModelLimits
    from batchfile.shard_input import decode_request, validate_stream

    path = write_tiny_embedding_model(tmp_path / "m", "qwen3", "mean", do_lower_case=True, default_prompt="Query: ")
    mixed = ["Hello World", "The QUICK brown Fox"]
    llm = LLM(str(path), num_kv_blocks=16)
    outs = llm.embed(mixed, use_tqdm=False)
    assert outs[0].prompt_token_ids == llm.llm_engine.tokenizer("query: hello world").input_ids
    assert_close([o.outputs.embedding for o in outs], st_encode(path, mixed))
    cased = write_tiny_embedding_model(tmp_path / "cased", "qwen3", "mean", default_prompt="Query: ")
    assert (
        LLM(str(cased), num_kv_blocks=16).embed(mixed[:1], use_tqdm=False)[0].prompt_token_ids
        != outs[0].prompt_token_ids
    )
    line = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": "emb", "input": mixed}}
    (item,) = validate_stream(
        io.BytesIO((json.dumps(line) + "\n").encode()), {"emb": ModelLimits.from_dir(path, name="emb")}
    )
    assert decode_request(item.shard_line).inputs == [o.prompt_token_ids for o in outs]
