"""Turn the last-position logits of each sequence into its next token.

Everything is batched on the device, and nothing waits for it until the end: per-row
settings are known on the host and go up in one asynchronous copy per stage, and the
sampled tokens (with any requested logprobs) come back in one transfer. The only per-row
work is for seeded requests, which draw their noise from their own generator so that a
seeded request gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain, repeat

import numpy as np
import torch

from engine.core.sequence import Sequence
from engine.runner.device import PendingFetch, to_device
from engine.sampling.structured_outputs import apply_grammar_bitmask
from engine.sampling.token_masks import apply_token_masks


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int):
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int]):
        """Returns (token ids as a list, per-row `SampleLogprobs` or None)."""
        return self.launch(logits, seqs, eos_ids).result()

    @torch.no_grad()
    def launch(self, logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int]) -> PendingSample:
        """The sampling queued on the device; nothing waits for it until `result()` (async scheduling
        feeds `tokens` into the next step's inputs before then)."""
        logits = logits.float()
        traits = _BatchTraits(seqs)
        want = traits.want_logprobs
        raw_logprobs = None
        if want:  # of the model's own distribution, before any edit (vLLM's raw_logprobs)
            raw_logprobs = torch.log_softmax(self._rows(logits, want), dim=-1)
        if not traits.plain:
            logits = apply_grammar_bitmask(logits, seqs)
            logits = apply_token_masks(logits, seqs)
            logits = self._suppress_early_stops(logits, seqs, eos_ids)
            logits = self._apply_penalties(logits, seqs)

        tokens = first_argmax(logits)
        if not traits.all_greedy:
            tokens = self._sample(logits, seqs, tokens)
        if raw_logprobs is None:
            return PendingSample(tokens)
        counts = [_num_top(seqs[i].params.logprobs, self.vocab_size) for i in want]
        chosen = raw_logprobs.gather(1, self._rows(tokens, want)[:, None])
        ranks = (raw_logprobs >= chosen).sum(dim=-1)  # vLLM counts ties as ranking above
        k = min(max(counts), raw_logprobs.shape[-1])
        top = raw_logprobs.topk(k, dim=-1) if k else None
        extra = (chosen.squeeze(1), ranks, *((top.values, top.indices) if top is not None else ()))
        return PendingSample(tokens, extra, want, counts)

    def _rows(self, t: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return t if len(rows) == t.shape[0] else t[to_device(rows, torch.long, self.device)]

    def _apply_penalties(self, logits, seqs):
        """vLLM's rules for all penalised rows at once: repetition over prompt and output
        tokens, presence and frequency over output tokens."""
        rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
        if not rows:
            return logits
        vocab = logits.shape[-1]
        pen = [seqs[i] for i in rows]
        outputs = [s.token_ids[s.num_prompt_tokens :] for s in pen]
        prompts = [s.token_ids[: s.num_prompt_tokens] if s.params.repetition_penalty != 1.0 else [] for s in pen]
        out_rows = list(chain.from_iterable(repeat(j, len(o)) for j, o in enumerate(outputs)))
        prompt_rows = list(chain.from_iterable(repeat(j, len(p)) for j, p in enumerate(prompts)))
        settings = [
            v for s in pen for v in (s.params.repetition_penalty, s.params.frequency_penalty, s.params.presence_penalty)
        ]
        n_out, n_prompt = len(out_rows), len(prompt_rows)
        # One copy: token rows and ids, then the settings' float64 bits.
        host = torch.cat(
            [
                torch.tensor(
                    out_rows + list(chain.from_iterable(outputs)) + prompt_rows + list(chain.from_iterable(prompts)),
                    dtype=torch.long,
                ),
                torch.tensor(settings, dtype=torch.float64).view(torch.long),
            ]
        )
        data = to_device(host, torch.long, logits.device)
        out_flat = data[:n_out] * vocab + data[n_out : 2 * n_out]
        ids_end = 2 * (n_out + n_prompt)
        prompt_flat = data[2 * n_out : 2 * n_out + n_prompt] * vocab + data[2 * n_out + n_prompt : ids_end]
        settings = data[ids_end:].view(torch.float64).float().view(len(rows), 3)
        rep, freq, presence = settings[:, 0:1], settings[:, 1:2], settings[:, 2:3]

        counts = torch.zeros(len(rows), vocab, device=logits.device)
        counts.view(-1).scatter_add_(0, out_flat, torch.ones(n_out, device=logits.device))
        seen = counts > 0
        seen.view(-1).scatter_(0, prompt_flat, True)
        sub = self._rows(logits, rows)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - (freq * counts + presence * (counts > 0).float())
        if len(rows) == logits.shape[0]:
            return sub
        return logits.index_put((to_device(rows, torch.long, logits.device),), sub)

    def _suppress_early_stops(self, logits, seqs, eos_ids):
        """Below min_tokens, a request's stop tokens and the EOS ids cannot be drawn (even with
        ignore_eos: vLLM bans all of its stop ids there)."""
        vocab = logits.shape[-1]
        rows, cols = [], []
        for i, s in enumerate(seqs):
            p = s.params
            if s.num_output_tokens < p.min_tokens:
                banned = [t for t in chain(p.stop_token_ids, eos_ids) if 0 <= t < vocab]
                rows.extend(repeat(i, len(banned)))
                cols.extend(banned)
        if not rows:
            return logits
        index = to_device(rows + cols, torch.long, logits.device)
        return logits.index_put((index[: len(rows)], index[len(rows) :]), logits.new_full((), float("-inf")))

    def _sample(self, logits, seqs, greedy_tokens):
        vocab = logits.shape[-1]
        # Greedy rows keep greedy_tokens; their temperature 1.0 just keeps the division finite.
        settings = to_device(
            [
                v
                for s in seqs
                for v in (
                    1.0 if s.params.greedy else s.params.temperature,
                    s.params.top_k or vocab,
                    s.params.top_p,
                    s.params.min_p,
                    float(s.params.greedy),
                )
            ],
            torch.float32,
            logits.device,
        ).view(len(seqs), 5)
        logits = logits / settings[:, 0:1]
        logits = self._truncate(logits, seqs, settings[:, 1].long(), settings[:, 2:3], settings[:, 3:4])
        probs = torch.softmax(logits, dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.params.seed is not None and not seq.params.greedy:
                noise[i].exponential_(generator=_seq_generator(seq, self.device))
        sampled = first_argmax(probs / noise)
        return torch.where(settings[:, 4] > 0, greedy_tokens, sampled)

    @staticmethod
    def _truncate(logits, seqs, top_k, top_p, min_p):
        if all(s.params.top_k == 0 and s.params.top_p == 1.0 and s.params.min_p == 0 for s in seqs):
            return logits
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        drop = ranks >= top_k[:, None]
        sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        drop |= before >= top_p
        drop |= sorted_probs < min_p * sorted_probs[:, :1]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class _BatchTraits:
    """What the batch needs of the sampler, found in one pass over its sequences: a batch of plain rows
    (no grammar, token masks, min_tokens or penalties) skips those stages' own passes."""

    def __init__(self, seqs: list[Sequence]):
        self.want_logprobs: list[int] = []
        self.plain = self.all_greedy = True
        for i, s in enumerate(seqs):
            p = s.params
            if p.logprobs is not None:
                self.want_logprobs.append(i)
            if self.all_greedy and not p.greedy:
                self.all_greedy = False
            if self.plain and (
                s.grammar is not None
                or p.min_tokens
                or p.logit_bias
                or p.allowed_token_ids is not None
                or p.bad_words
                or p.presence_penalty != 0.0
                or p.frequency_penalty != 0.0
                or p.repetition_penalty != 1.0
            ):
                self.plain = False


class PendingSample:
    """A step's sampled tokens (and logprob tensors) still on the device; `result()` reads them back
    in one wait."""

    def __init__(self, tokens: torch.Tensor, extra: tuple = (), want: list[int] = (), counts: list[int] = ()):
        self.tokens, self._want, self._counts = tokens, want, counts
        self._fetch = PendingFetch((tokens, *extra))  # queued now: reading it waits for this step alone

    def result(self) -> tuple[list[int], list[SampleLogprobs | None] | None]:
        lists = self._fetch.wait()
        if len(lists) == 1:
            return lists[0], None
        token_list, chosen, ranks = lists[:3]
        result: list[SampleLogprobs | None] = [None] * len(token_list)
        for j, i in enumerate(self._want):
            n = self._counts[j]
            top_ids, top_values = (lists[4][j][:n], lists[3][j][:n]) if n else ([], [])
            result[i] = SampleLogprobs(token_list[i], chosen[j], ranks[j], top_ids, top_values)
        return token_list, result


@dataclass
class SampleLogprobs:
    """One row's logprobs: the sampled token's value and rank, and the top tokens (best first)."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_values: list[float]


def first_argmax(t: torch.Tensor) -> torch.Tensor:
    """Each row's index of its first maximum (NaN counting as the largest, as torch's). On the CPU,
    numpy's vectorised, single-threaded argmax: torch's reduction with indices is not vectorised, and
    its threads wait for each other at every call (on 256 x 2,000 float32 logits: 0.04 ms against
    0.45 ms on one core, and several ms on two busy ones)."""
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.argmax(t.detach().numpy(), axis=-1))
    return t.max(dim=-1).indices


def _num_top(logprobs: int, vocab_size: int) -> int:
    return vocab_size if logprobs == -1 else logprobs


def _seq_generator(seq: Sequence, device: torch.device) -> torch.Generator:
    if seq.generator is None:
        seq.generator = torch.Generator(device=device)
        seq.generator.manual_seed(seq.params.seed + seq.index)
    return seq.generator
