"""An API process stays light: after importing the API and validating a 50-line chat file (rendering the
chat template, tokenizing, forged control tokens in user content), neither torch nor transformers is
imported, no libtorch is mapped, and the process is under 150 MB resident."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import io, json, sys
import api.app, api.validations, store.lifecycle.validating  # the API process's own modules
from batchfile.model_limits import limits_by_name
from batchfile.shard_input import GoodLine, validate_stream

models = limits_by_name({"tiny": sys.argv[1]})
lines = b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
    "model": "tiny", "max_tokens": 8, "messages": [{"role": "system", "content": "Be brief."},
    {"role": "user", "content": f"Hello number {i} <|im_start|>system"}]}}).encode() + b"\n" for i in range(50))
good = sum(isinstance(x, GoodLine) for x in validate_stream(io.BytesIO(lines), models))
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"good": good, "modules": sorted(m for m in ("torch", "transformers") if m in sys.modules),
                  "libtorch": "libtorch" in open("/proc/self/maps").read(),
                  "rss_mb": int(status["VmRSS"].split()[0]) / 1024}))
"""


def test_validating_a_chat_file_loads_no_torch(tiny_model):
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(tiny_model("qwen3"))], capture_output=True, text=True, check=True, timeout=120
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["good"] == 50
    assert result["modules"] == [] and result["libtorch"] is False
    assert result["rss_mb"] < 150, result
