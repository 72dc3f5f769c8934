"""Write tiny random-weight encoder directories (BERT, XLM-RoBERTa, ModernBERT) for tests, examples
and benchmarks: a sentence-transformers embedder, or a sequence classifier / cross-encoder. The
tokenizer is a small byte-level BPE (any script) trained on the fly with the family's special tokens
and pair template."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.testing.tiny import _CORPUS
from engine.testing.tiny_embedding import write_sentence_transformers_files

ENCODER_FAMILIES = ("bert", "xlm-roberta", "modernbert", "nomic-bert")
# family -> special tokens in id order, and (cls, sep, pad, unk, mask)
_SPECIALS = {
    "bert": (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], ("[CLS]", "[SEP]", "[PAD]", "[UNK]", "[MASK]")),
    "xlm-roberta": (["<s>", "<pad>", "</s>", "<unk>", "<mask>"], ("<s>", "</s>", "<pad>", "<unk>", "<mask>")),
}
_SPECIALS["modernbert"] = _SPECIALS["nomic-bert"] = _SPECIALS["bert"]


def build_encoder_tokenizer(family: str, vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    specials, (cls, sep, pad, unk, mask) = _SPECIALS[family]
    tok = Tokenizer(models.BPE(unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    ids = {t: tok.token_to_id(t) for t in (cls, sep)}
    if family == "xlm-roberta":
        pair = f"{cls} $A {sep} {sep} $B {sep}"
    else:
        pair = f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1"
    tok.post_processor = TemplateProcessing(single=f"{cls} $A {sep}", pair=pair, special_tokens=list(ids.items()))
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if family in ("bert", "nomic-bert") else [])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        cls_token=cls,
        sep_token=sep,
        pad_token=pad,
        unk_token=unk,
        mask_token=mask,
        model_input_names=names,
    )


def tiny_encoder_config(family: str, tokenizer, num_labels: int | None = None, **overrides):
    import transformers

    if family not in ENCODER_FAMILIES:
        raise ValueError(f"unknown encoder family {family!r}; choose from {ENCODER_FAMILIES}")
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        initializer_range=0.1,
        pad_token_id=tokenizer.pad_token_id,
    )
    if family == "bert":
        kwargs.update(max_position_embeddings=256, type_vocab_size=2)
        cls = transformers.BertConfig
    elif family == "xlm-roberta":
        kwargs.update(
            max_position_embeddings=256 + tokenizer.pad_token_id + 1,
            type_vocab_size=1,
            bos_token_id=tokenizer.cls_token_id,
            eos_token_id=tokenizer.sep_token_id,
        )
        cls = transformers.XLMRobertaConfig
    elif family == "nomic-bert":
        kwargs.update(max_position_embeddings=512, type_vocab_size=2, intermediate_size=96, hidden_act="silu")
        cls = transformers.NomicBertConfig
    else:
        kwargs.update(
            max_position_embeddings=512,
            num_hidden_layers=4,
            intermediate_size=96,
            local_attention=16,
            cls_token_id=tokenizer.cls_token_id,
            sep_token_id=tokenizer.sep_token_id,
            bos_token_id=tokenizer.cls_token_id,
            eos_token_id=tokenizer.sep_token_id,
        )
        cls = transformers.ModernBertConfig
    if num_labels is not None:
        kwargs.update(
            num_labels=num_labels,
            id2label={i: f"LABEL_{chr(65 + i)}" for i in range(num_labels)},
            label2id={f"LABEL_{chr(65 + i)}": i for i in range(num_labels)},
        )
    kwargs.update(overrides)
    return cls(**kwargs)


def write_tiny_encoder(
    path,
    family: str = "bert",
    pooling: str = "mean",
    normalize: bool = True,
    seed: int = 0,
    default_prompt: str | None = None,
    max_seq_length: int | None = None,
    dense_out: int | None = None,
    **overrides,
) -> Path:
    """A sentence-transformers embedding model directory; `dense_out`: a Dense layer (tanh) to that size."""
    from transformers import AutoModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_encoder_tokenizer(family)
    config = tiny_encoder_config(family, tokenizer, **overrides)
    torch.manual_seed(seed)
    AutoModel.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    dense = None
    if dense_out:
        dense = [
            {
                "in_features": config.hidden_size,
                "out_features": dense_out,
                "bias": True,
                "activation_function": "torch.nn.modules.activation.Tanh",
                "weight": torch.randn(dense_out, config.hidden_size) * 0.2,
                "bias_tensor": torch.randn(dense_out) * 0.1,
            }
        ]
    limit = config.max_position_embeddings - (config.pad_token_id + 1 if family == "xlm-roberta" else 0)
    write_sentence_transformers_files(
        path, config.hidden_size, pooling, normalize, default_prompt, max_seq_length or min(limit, 256), dense=dense
    )
    _note(path, family, seed, f"sentence-transformers embedder, {pooling} pooling")
    return path


def write_tiny_classifier(
    path,
    family: str = "bert",
    num_labels: int = 3,
    seed: int = 0,
    cross_encoder_activation: str | None = None,
    **overrides,
) -> Path:
    """A `*ForSequenceClassification` directory: a classifier, or with num_labels=1 a cross-encoder
    (`cross_encoder_activation`: "Sigmoid" or "Identity" written as sentence-transformers' CrossEncoder does)."""
    from transformers import AutoModelForSequenceClassification

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_encoder_tokenizer(family)
    config = tiny_encoder_config(family, tokenizer, num_labels=num_labels, **overrides)
    if cross_encoder_activation:
        config.sentence_transformers = {"activation_fn": f"torch.nn.modules.activation.{cross_encoder_activation}"}
    torch.manual_seed(seed)
    AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    _note(path, family, seed, "cross-encoder" if num_labels == 1 else f"classifier, {num_labels} labels")
    return path


def _note(path: Path, family: str, seed: int, kind: str) -> None:
    note = f"tiny random-weight encoder ({kind}) written by engine.testing.tiny_encoder"
    meta = {"note": note, "arch": family, "seed": seed}
    (path / "pagedbatch_tiny.json").write_text(json.dumps(meta))
