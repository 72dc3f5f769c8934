"""Turn the last-position logits of each sequence into its next token.

Everything is batched on the device; the only per-row work is for seeded requests,
which draw their noise from their own generator so that a seeded request gives the
same tokens whatever else shares the batch.
"""

from __future__ import annotations

import torch

from engine.sequence import Sequence


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int):
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int]):
        """Returns (token ids as a list, per-row top logprobs dicts or None)."""
        logits = logits.float()
        raw_logprobs = None
        if any(s.params.logprobs is not None for s in seqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_penalties(logits, seqs)
        logits = self._suppress_early_stops(logits, seqs, eos_ids)

        greedy = torch.tensor([s.params.greedy for s in seqs], device=logits.device)
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            sampled = self._sample(logits, seqs)
            tokens = torch.where(greedy, tokens, sampled)
        token_list = tokens.tolist()
        return token_list, self._top_logprobs(raw_logprobs, seqs, token_list)

    def _apply_penalties(self, logits, seqs):
        rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:  # penalties need each row's token history; a row's work is all on the device
            p, seq = seqs[i].params, seqs[i]
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(seq.token_ids)), device=logits.device)
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
                out = torch.tensor(seq.output_token_ids, device=logits.device)
                counts = torch.bincount(out, minlength=logits.shape[-1])[: logits.shape[-1]].float()
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        return logits

    def _suppress_early_stops(self, logits, seqs, eos_ids):
        rows = [i for i, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            p = seqs[i].params
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))
            banned = [t for t in banned if 0 <= t < logits.shape[-1]]
            if banned:
                logits[i, banned] = float("-inf")
        return logits

    def _sample(self, logits, seqs):
        # Greedy rows take the argmax later; 1.0 just keeps their division finite.
        temps = torch.tensor([1.0 if s.params.greedy else s.params.temperature for s in seqs],
                             device=logits.device)
        logits = logits / temps[:, None]
        logits = self._truncate(logits, seqs)
        probs = torch.softmax(logits, dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.params.seed is not None and not seq.params.greedy:
                noise[i].exponential_(generator=_seq_generator(seq, self.device))
        return (probs / noise).argmax(dim=-1)

    def _truncate(self, logits, seqs):
        top_k = [s.params.top_k for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        min_p = [s.params.min_p for s in seqs]
        if all(k == 0 for k in top_k) and all(p == 1.0 for p in top_p) and all(m == 0 for m in min_p):
            return logits
        device = logits.device
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[-1], device=device)[None, :]
        k = torch.tensor([k or logits.shape[-1] for k in top_k], device=device)
        drop = ranks >= k[:, None]
        sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        drop |= before >= torch.tensor(top_p, device=device)[:, None]
        drop |= sorted_probs < torch.tensor(min_p, device=device)[:, None] * sorted_probs[:, :1]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)

    def _top_logprobs(self, raw_logprobs, seqs, tokens):
        if raw_logprobs is None:
            return None
        result = []
        for i, seq in enumerate(seqs):
            k = seq.params.logprobs
            if k is None:
                result.append(None)
                continue
            entry = {tokens[i]: float(raw_logprobs[i, tokens[i]])}
            if k:
                values, ids = raw_logprobs[i].topk(k)
                entry.update(zip(ids.tolist(), values.tolist()))
            result.append(entry)
        return result


def _seq_generator(seq: Sequence, device: torch.device) -> torch.Generator:
    if seq.generator is None:
        seq.generator = torch.Generator(device=device)
        seq.generator.manual_seed(seq.params.seed + seq.index)
    return seq.generator
