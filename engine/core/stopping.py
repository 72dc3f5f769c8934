"""When a sequence stops, as vLLM decides it: EOS and stop token ids, stop strings in the new text,
max_tokens and the context length; the text is trimmed the way vLLM trims it."""

from __future__ import annotations

from engine.core.sequence import Sequence
from engine.hf.tokenizer import Detokenizer


class StopChecker:
    def __init__(self, eos_token_id: int | None, extra_eos_ids: set[int], detokenizer: Detokenizer, max_model_len: int):
        self.eos_token_id = eos_token_id
        self.extra_eos_ids = extra_eos_ids
        self.detokenizer = detokenizer
        self.max_model_len = max_model_len

    def check(self, seq: Sequence) -> tuple[str, int | str | None] | None:
        """(finish_reason, stop_reason) if the latest token ends `seq`, else None.

        Only a sequence with stop strings needs its text at every step; the others' text is decoded
        in one chunk when they stop (`catch_up`), which gives the same text for far less work."""
        p = seq.params
        limit = (
            self.max_model_len
            if p.max_tokens is None
            else min(seq.num_prompt_tokens + p.max_tokens, self.max_model_len)
        )
        if not p.stop and len(seq.token_ids) < limit:
            # the common case, decided in a few comparisons: no stop strings and short of any length limit
            token = seq.token_ids[-1]
            if token != self.eos_token_id and token not in p.stop_token_ids and token not in self.extra_eos_ids:
                return None
        stopped, stop = self._stop_token(seq)
        if stopped:  # the stop token's text is left out unless include_stop_str_in_output
            self.catch_up(seq, None if p.include_stop_str_in_output else len(seq) - 1, final=True)
            return "stop", stop
        # As vLLM: the text of the first min_tokens tokens cannot complete a stop string.
        if p.stop_strings and p.detokenize:
            new_text = self.detokenizer.decode_new_text(seq)
            if seq.num_output_tokens > p.min_tokens:
                stop = _find_stop_string(seq, len(new_text))
                if stop:
                    return "stop", stop
        return self.check_length(seq)

    def check_length(self, seq: Sequence) -> tuple[str, None] | None:
        """("length", None) once `seq` has max_tokens output tokens or fills the context, else None."""
        p = seq.params
        if (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or len(seq) >= self.max_model_len:
            self.catch_up(seq, final=True)
            return "length", None
        return None

    def catch_up(self, seq: Sequence, end: int | None = None, final: bool = False) -> None:
        """Decode the text of `seq`'s tokens before `end` (default all) not yet decoded; `final`: also
        what is held back as an incomplete character (the sequence ends)."""
        if seq.params.detokenize:
            self.detokenizer.decode_new_text(seq, end)
            if final:
                self.detokenizer.flush(seq, end)

    def _stop_token(self, seq: Sequence) -> tuple[bool, int | None]:
        """(stopped, stop_reason) for the latest token: EOS or a stop token id, as in vLLM."""
        p, token = seq.params, seq.token_ids[-1]
        if seq.num_output_tokens < p.min_tokens:
            return False, None
        if token == self.eos_token_id and not p.ignore_eos:
            return True, None
        if token in p.stop_token_ids or (token in self.extra_eos_ids and not p.ignore_eos):
            return True, token
        return False, None


def _find_stop_string(seq: Sequence, new_chars: int) -> str | None:
    """Look for a stop string that the newest text completed; trim the text before the earliest one
    and return it, or None. Only matches ending in the new text are looked for, at a cost that does
    not grow with the number of stop strings."""
    found = seq.stop_strings.earliest_completed(seq.output_text, new_chars)
    if found is None:
        return None
    pos, stop = found
    seq.output_text = seq.output_text[: pos + (len(stop) if seq.params.include_stop_str_in_output else 0)]
    return stop
