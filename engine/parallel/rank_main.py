"""A tensor-parallel rank other than 0: joins the group (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK),
loads its share of the model and runs rank 0's steps until rank 0 stops it. Rank 0 starts these on its
own machine; on another host, start one per rank with the engine options rank 0 was given:

    MASTER_ADDR=host0 MASTER_PORT=29500 WORLD_SIZE=2 RANK=1 \\
        python -m engine.parallel.rank_main --model /models/m --options '{"dtype": "bfloat16"}'

Exits 0 when stopped, 1 with the reason on stderr when anything fails (rank 0 gone included)."""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import pickle
import sys
import threading
import time

from engine.hf.config import EngineConfig, ModelConfig, resolve_device, resolve_dtype
from engine.parallel.group import destroy_group, init_group, rank_device
from engine.parallel.runner import TensorParallelRunner
from settings import EngineSettings, current

log = logging.getLogger("engine.parallel.rank")


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine.parallel.rank_main")
    parser.add_argument("--model", help="the model directory or hub id rank 0 was given")
    parser.add_argument("--options", default="{}", help="rank 0's engine options as a JSON object")
    parser.add_argument("--spec", help=argparse.SUPPRESS)  # rank 0's own configs, pickled, when it started us
    parser.add_argument("--parent", type=int, help=argparse.SUPPRESS)  # rank 0's pid, when it started us
    args = parser.parse_args(argv)
    if not (args.spec or args.model):
        parser.error("--model is required")
    return args


def _configs(args: argparse.Namespace, world: int):
    if args.spec:
        return pickle.loads(base64.b64decode(args.spec))
    options = dict(json.loads(args.options), tensor_parallel_size=world)
    config = EngineConfig(model=args.model, **options)
    model_config = ModelConfig.load(args.model, config.max_model_len, config.revision, config.hf_overrides)
    device = resolve_device(config.device)
    return config, model_config, str(device), resolve_dtype(config.dtype, device, model_config.torch_dtype)


def _exit_with_parent(parent: int) -> None:
    """A started rank ends when rank 0's process does (its collectives would fail anyway)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank %(process)d %(levelname)s %(message)s")
    args = _arguments(sys.argv[1:] if argv is None else argv)
    env = current(EngineSettings)
    if env.world_size is None or env.rank is None or not env.master_addr or env.master_port is None:
        log.error("a tensor-parallel rank needs MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK")
        return 1
    if args.parent:
        threading.Thread(target=_exit_with_parent, args=(args.parent,), daemon=True).start()
    try:
        config, model_config, device, dtype = _configs(args, env.world_size)
        device = rank_device(resolve_device(device), env.rank)
        group = init_group(env.rank, env.world_size, env.master_addr, env.master_port, device)
        runner = TensorParallelRunner(config, model_config, device, dtype, group)
        runner.serve()
    except Exception as exc:  # noqa: BLE001 - one line saying why, then the exit status
        log.error("tensor-parallel rank %d of %d failed: %s: %s", env.rank, env.world_size, type(exc).__name__, exc)
        return 1
    destroy_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
