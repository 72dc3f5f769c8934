"""pyarrow's first conversion of Python values imports pandas (about 0.3 s of CPU, a second of wall time on a
busy machine) only to ask whether the values are pandas objects; the results rows never are.
`skip_pandas_probe` answers that first question with "no pandas" when pandas is not imported yet. pyarrow
keeps the answer for its probes and imports pandas again whenever it is asked for pandas itself
(`to_pandas`, `from_pandas`, `pa.array` without a type), so nothing else changes."""

from __future__ import annotations

import sys
import threading

import pyarrow as pa

_lock = threading.Lock()
_done = False


class _NoPandas:
    def find_spec(self, name, path=None, target=None):
        if name == "pandas":
            raise ModuleNotFoundError("skipped for pyarrow's probe", name="pandas")
        return None


def skip_pandas_probe() -> None:
    """Make pyarrow's pandas probe (made once per process) answer without importing pandas."""
    global _done
    with _lock:
        if _done or "pandas" in sys.modules:
            _done = True
            return
        finder = _NoPandas()
        sys.meta_path.insert(0, finder)
        try:
            pa.array([], type=pa.int64())  # the probe: pyarrow tries to import pandas here, once
        finally:
            sys.meta_path.remove(finder)
            _done = True
