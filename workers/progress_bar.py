"""The bar people watch while requests run (`pagedbatch run`, `pagedbatch submit --wait`): requests done of the
total, tokens generated per second, and tqdm's ETA from the request rate. Drawn only on a terminal: piped
or redirected, nothing is written (a log file gets no carriage-return noise)."""

from __future__ import annotations

import sys
import time

FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} req [{elapsed}<{remaining}{postfix}]"


class RequestBar:
    def __init__(self, total: int | None, enabled: bool = True, stream=None, desc: str = "requests"):
        from tqdm import tqdm

        stream = stream or sys.stderr
        self.shown = enabled and stream.isatty()
        self._bar = tqdm(
            total=total,
            desc=desc,
            file=stream,
            disable=not self.shown,
            dynamic_ncols=True,
            bar_format=FORMAT,
            mininterval=0.2,
        )
        self._started = time.monotonic()
        self._tokens = 0
        self._note = ""

    def update(self, requests: int = 0, tokens: int = 0) -> None:
        """`requests` more done, `tokens` more generated."""
        self._tokens += tokens
        self._postfix()
        if requests:
            self._bar.update(requests)

    def set(self, done: int, tokens: int, note: str = "") -> None:
        """Absolute counts (a job polled from the API), and why it waits if it does."""
        self._tokens, self._note = tokens, note
        self._postfix()
        self._bar.update(max(done - self._bar.n, 0))

    def _postfix(self) -> None:
        rate = self._tokens / max(time.monotonic() - self._started, 1e-6)
        text = f"{rate:,.0f} tok/s" + (f", {self._note}" if self._note else "")
        self._bar.set_postfix_str(text, refresh=False)

    def close(self) -> None:
        self._bar.close()
