"""What an encoder checkpoint's `config.json` says (BERT, RoBERTa/XLM-RoBERTa, ModernBERT, NomicBERT), read
without torch. Encoders attend bidirectionally over each whole input and keep no KV cache: they run
through `engine.runner.encoder_runner`, not the paged decoder path.

A `*ForSequenceClassification` architecture is a classifier or cross-encoder: its head's logits
are what `LLM.classify` and `LLM.score` return (probabilities through the activation its config
asks for)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.hf.model_info import context_length

# architecture -> (family, has a sequence-classification head)
ENCODER_ARCHITECTURES = {
    "BertModel": ("bert", False),
    "BertForSequenceClassification": ("bert", True),
    "RobertaModel": ("roberta", False),
    "RobertaForSequenceClassification": ("roberta", True),
    "XLMRobertaModel": ("roberta", False),
    "XLMRobertaForSequenceClassification": ("roberta", True),
    "ModernBertModel": ("modernbert", False),
    "ModernBertForSequenceClassification": ("modernbert", True),
    "NomicBertModel": ("nomic_bert", False),  # as transformers writes it (not the hub's custom-code layout)
}
_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu")


def encoder_architecture(raw: dict) -> str | None:
    return next((a for a in raw.get("architectures") or [] if a in ENCODER_ARCHITECTURES), None)


@dataclass
class EncoderConfig:
    path: Path
    architecture: str
    family: str  # bert | roberta | modernbert | nomic_bert
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    hidden_act: str
    norm_eps: float
    max_position_embeddings: int
    max_model_len: int
    pad_token_id: int | None
    type_vocab_size: int = 0
    position_offset: int = 0  # RoBERTa: positions start after the padding id
    # ModernBERT
    layer_windows: list[int | None] = field(default_factory=list)  # half window per layer (None: global)
    layer_thetas: list[float] = field(default_factory=list)
    norm_bias: bool = True
    attention_bias: bool = True
    mlp_bias: bool = True
    # the classification head
    classifier: bool = False
    num_labels: int = 0
    id2label: dict[int, str] = field(default_factory=dict)
    classifier_pooling: str = "cls"
    classifier_activation: str = "gelu"
    classifier_bias: bool = True
    score_activation: str | None = None  # cross-encoder's: "sigmoid", "identity" or None (as vLLM by labels)
    torch_dtype: str | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    is_encoder: bool = True

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @classmethod
    def from_dict(cls, raw: dict, path: Path, max_model_len: int | None = None) -> EncoderConfig:
        arch = encoder_architecture(raw)
        if arch is None:
            raise ValueError(f"not an encoder architecture: {raw.get('architectures')!r}")
        family, classifier = ENCODER_ARCHITECTURES[arch]
        act = raw.get("hidden_activation") or raw.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}; supported: {_ACTIVATIONS}")
        if family in ("bert", "roberta") and raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type={raw['position_embedding_type']!r} is not supported")
        heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
        pad = raw.get("pad_token_id")
        offset = (pad + 1) if family == "roberta" else 0
        positions = raw["max_position_embeddings"] - offset
        length = context_length({**raw, "max_position_embeddings": positions}, max_model_len)
        labels = raw.get("id2label") or {}
        num_labels = len(labels) if labels else int(raw.get("num_labels", 2))
        cfg = cls(
            path=path,
            architecture=arch,
            family=family,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            head_dim=hidden // heads,
            hidden_act=act,
            norm_eps=raw.get("norm_eps", raw.get("layer_norm_eps", 1e-12)),
            max_position_embeddings=raw["max_position_embeddings"],
            max_model_len=length,
            pad_token_id=pad,
            type_vocab_size=raw.get("type_vocab_size", 0) if family != "modernbert" else 0,
            position_offset=offset,
            classifier=classifier,
            num_labels=num_labels if classifier else 0,
            id2label={int(k): v for k, v in labels.items()},
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            score_activation=_score_activation(raw),
        )
        if family == "modernbert":
            cfg._modernbert(raw)
        if family == "nomic_bert":
            rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
            if rope.get("rope_type", "default") != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
                raise ValueError(f"NomicBERT rope {rope!r} is not supported (plain rotary only)")
            cfg.layer_thetas = [rope.get("rope_theta", raw.get("rope_theta", 10000.0))] * cfg.num_layers
            if raw.get("head_dim") not in (None, cfg.head_dim):
                raise ValueError("NomicBERT with head_dim other than hidden_size / heads is not supported")
        return cfg

    def _modernbert(self, raw: dict) -> None:
        every = raw.get("global_attn_every_n_layers", 3)
        types = raw.get("layer_types") or [
            "sliding_attention" if i % every else "full_attention" for i in range(self.num_layers)
        ]
        rope = raw.get("rope_parameters") or {}
        thetas = {
            "full_attention": (rope.get("full_attention") or {}).get("rope_theta")
            or raw.get("global_rope_theta", 160000.0),
            "sliding_attention": (rope.get("sliding_attention") or {}).get("rope_theta")
            or raw.get("local_rope_theta", 10000.0),
        }
        for part in rope.values():
            if isinstance(part, dict) and part.get("rope_type", "default") != "default":
                raise ValueError(f"ModernBERT rope_type {part['rope_type']!r} is not supported")
        half = raw.get("local_attention", 128) // 2
        self.layer_windows = [half if t == "sliding_attention" else None for t in types]
        self.layer_thetas = [thetas[t] for t in types]
        self.norm_bias = bool(raw.get("norm_bias", False))
        self.attention_bias = bool(raw.get("attention_bias", False))
        self.mlp_bias = bool(raw.get("mlp_bias", False))
        self.classifier_pooling = raw.get("classifier_pooling", "cls")
        self.classifier_activation = raw.get("classifier_activation", "gelu")
        self.classifier_bias = bool(raw.get("classifier_bias", False))
        if self.classifier_pooling not in ("cls", "mean"):
            raise ValueError(f"classifier_pooling={self.classifier_pooling!r} is not supported")
        if self.classifier_activation not in _ACTIVATIONS:
            raise ValueError(f"unsupported classifier_activation {self.classifier_activation!r}")


def _score_activation(raw: dict) -> str | None:
    """A sentence-transformers CrossEncoder's activation, from its config.json (v4+:
    `sentence_transformers.activation_fn`; before: `sbert_ce_default_activation_function`)."""
    name = (raw.get("sentence_transformers") or {}).get("activation_fn") or raw.get(
        "sbert_ce_default_activation_function"
    )
    if not name:
        return None
    short = name.rsplit(".", 1)[-1].lower()
    if short not in ("sigmoid", "identity"):
        raise ValueError(f"cross-encoder activation {name!r} is not supported; supported: Sigmoid, Identity")
    return short
