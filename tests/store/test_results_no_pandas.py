"""Writing and counting results never imports pandas (pyarrow would, for its first conversion: a second of
start-up), and pandas still works with pyarrow afterwards in the same process."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import json, sys
from batchfile.errors import INVALID_JSON, LineError
from store.results.parquet import count_results, count_table, write_results
from store.results.rows import error_row, rows_to_table

out = sys.argv[1]
rows = [error_row(LineError(line, f"c{line}", INVALID_JSON, "bad"), created_at=1.0, finished_at=2.0)
        for line in (2, 1)]
table = rows_to_table(rows)
write_results(out, table)
counts = (count_table(table).failed, count_results(out).failed)
imported = "pandas" in sys.modules

import pandas as pd
import pyarrow as pa

frame = table.to_pandas()
series = pa.array(pd.Series([1, 2]))
back = pa.Table.from_pandas(pd.DataFrame({"a": [1.5]}))
print(json.dumps({"imported": imported, "counts": counts, "lines": frame["line"].tolist(),
                  "series": [str(series.type), series.to_pylist()], "back": back.column("a").to_pylist()}))
"""


def test_results_without_pandas_then_pandas_works(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "out.parquet")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {
        "imported": False,
        "counts": [2, 2],
        "lines": [1, 2],
        "series": ["int64", [1, 2]],
        "back": [1.5],
    }
