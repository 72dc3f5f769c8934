"""The process's peak resident set size (RSS) while a block runs, from Linux's /proc/self/status.

Writing "5" to /proc/self/clear_refs resets the peak (VmHWM) to the current RSS; after the block, VmHWM
minus the RSS before it is how far the block raised the process's real memory at its worst.
"""

from __future__ import annotations

import gc


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def current_rss() -> int:
    """The process's resident set size now, in bytes."""
    return _status_kib("VmRSS") * 1024


class PeakRSS:
    """`with PeakRSS() as rss: ...`; then `rss.growth` (bytes): peak RSS during the block minus RSS before it."""

    def __enter__(self) -> PeakRSS:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.before = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc) -> None:
        self.peak = _status_kib("VmHWM") * 1024
        self.growth = self.peak - self.before
