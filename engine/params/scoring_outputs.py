"""vLLM's outputs of `LLM.classify` and `LLM.score` (`vllm/outputs.py`: ClassificationOutput,
ClassificationRequestOutput, ScoringOutput, ScoringRequestOutput). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from engine.params.pooling_outputs import PoolingRequestOutput


@dataclass
class ClassificationOutput:
    probs: list[float]
    label: str | None = None  # the most probable class's name from the model's id2label (ours; not in vLLM)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput, id2label: dict[int, str]) -> ClassificationRequestOutput:
        probs = out.outputs.data.tolist()
        best = max(range(len(probs)), key=probs.__getitem__)
        return cls(out.request_id, ClassificationOutput(probs, id2label.get(best)), out.prompt_token_ids, out.finished)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
