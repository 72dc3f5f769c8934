"""Stop-string matching whose cost per step does not grow with the number of stop strings.

The strings are grouped by length in hash sets. A step that added `new_chars` characters checks, for each
position where a match could end inside the new text and each distinct length, one slice against one set:
O(new_chars x distinct lengths), whatever the number of stop strings.
"""

from __future__ import annotations


class StopStrings:
    """A request's stop strings, indexed once, shared by its n sequences."""

    def __init__(self, stops: list[str]):
        by_length: dict[int, set[str]] = {}
        for stop in stops:
            by_length.setdefault(len(stop), set()).add(stop)
        self._by_length = sorted(by_length.items())

    def __bool__(self) -> bool:
        return bool(self._by_length)

    def earliest_completed(self, text: str, new_chars: int) -> tuple[int, str] | None:
        """The earliest (position, stop string) among occurrences that end inside the last `new_chars`
        characters of `text` (ties on position: the smallest string), or None."""
        best: tuple[int, str] | None = None
        for end in range(max(0, len(text) - new_chars) + 1, len(text) + 1):
            for length, stops in self._by_length:
                start = end - length
                if start < 0:
                    break
                if best is not None and start > best[0]:
                    continue
                candidate = text[start:end]
                if candidate in stops and (best is None or (start, candidate) < best):
                    best = (start, candidate)
        return best
