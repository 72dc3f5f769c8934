"""`LLM.beam_search`'s meaning, as vLLM's: each step extends every live beam by one token
(2 * beam_width logprobs per beam), keeps the best `beam_width` candidates per prompt by
cumulative logprob / length ** length_penalty, and sets finished (EOS) beams aside. This module
is the arithmetic; `engine.beam.runner` runs the beams as live sequences in the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.params.outputs import Logprob


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


def next_beams(
    beams: list[BeamSearchSequence],
    entries: list[dict[int, Logprob]],
    eos_token_id: int | None,
    params: BeamSearchParams,
) -> tuple[list[tuple[int, BeamSearchSequence]], list[BeamSearchSequence]]:
    """One step of vLLM's beam search: each beam extended by every token of its logprob entry;
    those ended by EOS (unless ignore_eos) are set aside as finished, the best `beam_width`
    others kept. Returns ([(index of the beam it extends, new beam)], best first; finished)."""
    candidates, finished = [], []
    for i, (beam, entry) in enumerate(zip(beams, entries)):
        for token, lp in entry.items():
            new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [entry], beam.cum_logprob + lp.logprob)
            if token == eos_token_id and not params.ignore_eos:
                new.finish_reason = "stop"
                finished.append(new)
            else:
                candidates.append((i, new))
    candidates.sort(key=lambda c: score(c[1], eos_token_id, params), reverse=True)  # stable: ties keep order
    return candidates[: params.beam_width], finished


def score(beam: BeamSearchSequence, eos_token_id: int | None, params: BeamSearchParams) -> float:
    return beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, params.length_penalty)


def best_sequences(
    live: list[BeamSearchSequence],
    finished: list[BeamSearchSequence],
    eos_token_id: int | None,
    params: BeamSearchParams,
    tokenizer,
) -> BeamSearchOutput:
    """A prompt's output: the best `beam_width` of its finished and still live beams."""
    for beam in live:
        beam.finish_reason = "length"
    best = sorted(finished + live, key=lambda b: score(b, eos_token_id, params), reverse=True)[: params.beam_width]
    for beam in best:
        beam.text = tokenizer.decode(beam.tokens)
    return BeamSearchOutput(best)
