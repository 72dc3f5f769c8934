"""`LLM.beam_search`, as vLLM's: each step extends every live beam by one token through the
ordinary engine (2 * beam_width logprobs per beam), keeps the best `beam_width` candidates per
prompt by cumulative logprob / length ** length_penalty, and sets finished (EOS) beams aside.
Beams share their prompt's full KV blocks through the prefix cache; the last partial block is
recomputed for each beam (as in vLLM's offline beam search; no copy-on-write)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.outputs import Logprob
from engine.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be a positive integer, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")


@dataclass
class BeamSearchSequence:
    """`tokens` holds the prompt and the output, as in vLLM; `text` decodes all of them."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first, at most beam_width


def beam_search_score(tokens: list[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float) -> float:
    """vLLM's score: the length counts the prompt, not a final EOS."""
    length = len(tokens) - (1 if tokens[-1] == eos_token_id else 0)
    return cum_logprob / (max(length, 1) ** length_penalty)


def run_beam_search(llm, token_prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    eos = llm.llm_engine.eos_token_id
    step_params = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature)

    def score(beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)

    live = [[BeamSearchSequence(list(ids))] for ids in token_prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in token_prompts]
    for _ in range(params.max_tokens):
        flat = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not flat:
            break
        outs = llm.generate([{"prompt_token_ids": b.tokens} for _, b in flat], step_params, use_tqdm=False)
        candidates: list[list[BeamSearchSequence]] = [[] for _ in token_prompts]
        for (i, beam), out in zip(flat, outs):
            entry = out.outputs[0].logprobs[0]
            for token, lp in entry.items():
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [entry], beam.cum_logprob + lp.logprob)
                if token == eos and not params.ignore_eos:
                    new.finish_reason = "stop"
                    done[i].append(new)
                else:
                    candidates[i].append(new)
        live = [sorted(c, key=score, reverse=True)[: params.beam_width] for c in candidates]
    tokenizer = llm.get_tokenizer()
    outputs = []
    for beams, finished in zip(live, done):
        for beam in beams:
            beam.finish_reason = "length"
        best = sorted(finished + beams, key=score, reverse=True)[: params.beam_width]
        for beam in best:
            beam.text = tokenizer.decode(beam.tokens)
        outputs.append(BeamSearchOutput(best))
    return outputs
