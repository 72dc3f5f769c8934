"""`--lora NAME=DIR` on serve, worker and run: parsed and checked before anything starts, handed by `serve` to its
worker, and the engine options it implies (enable_lora; max_loras and max_lora_rank from the adapters unless given)."""

from __future__ import annotations

import json

import pytest

from pagedbatch.cli import build_parser
from pagedbatch.commands.server_commands import checked_loras
from pagedbatch.engine_options import engine_kwargs
from pagedbatch.failures import CliError
from pagedbatch.supervisor import worker_command


def _adapter(path, r):
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "rank_pattern": {"q": r * 2}}))
    return str(path)


def test_serve_hands_its_adapters_to_the_worker(tmp_path):
    a, b = _adapter(tmp_path / "a", 4), _adapter(tmp_path / "b", 8)
    args = build_parser().parse_args(["serve", "--model", "base=/m", f"--lora=sql={a}", f"--lora=chat={b}"])
    assert engine_kwargs(args) == {
        "device": "auto",
        "dtype": "auto",
        "max_num_seqs": 256,
        "enable_lora": True,
        "max_loras": 2,
        "max_lora_rank": 16,
        "tensor_parallel_size": 1,
    }
    worker = build_parser().parse_args(worker_command("base", "/m", args)[3:])
    assert engine_kwargs(worker) == engine_kwargs(args)
    given = build_parser().parse_args(
        ["worker", "--model", "base=/m", f"--lora=sql={a}", "--max-loras=1", "--max-lora-rank=32"]
    )
    assert engine_kwargs(given)["max_loras"] == 1 and engine_kwargs(given)["max_lora_rank"] == 32
    checked_loras(args, 1)


def test_bad_lora_items_are_usage_errors(tmp_path):
    a = _adapter(tmp_path / "a", 4)
    for items, words in (
        ([f"--lora=x{a}"], "NAME=DIR"),
        ([f"--lora=x={tmp_path}"], "not a PEFT adapter"),
        ([f"--lora=x={a}", f"--lora=x={a}"], "given twice"),
    ):
        args = build_parser().parse_args(["serve", "--model", "base=/m", *items])
        with pytest.raises(CliError, match=words):
            checked_loras(args, 1)
    two = build_parser().parse_args(["serve", "--model", "a=/m", "--model", "b=/n", f"--lora=x={a}"])
    with pytest.raises(CliError, match="exactly one --model"):
        checked_loras(two, 2)
