"""Rank 0 of a tensor-parallel engine: it starts ranks 1..N-1 as processes of this machine (loopback
TCP, a free port) or, when MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK are set, joins the group they
describe (the other ranks started by `python -m engine.parallel.rank_main` on their hosts). A watchdog
thread reports a started rank that exits; each started rank ends itself when rank 0's process goes."""

from __future__ import annotations

import atexit
import base64
import logging
import os
import pickle
import subprocess
import sys
import threading
import time

import torch

from engine.hf.config import EngineConfig, ModelConfig
from engine.hf.model_info import read_config
from engine.multimodal.families import multimodal_family
from engine.parallel.group import destroy_group, free_port, init_group, joined_from_env, rank_device
from engine.parallel.runner import TensorParallelRunner
from engine.parallel.sharding import check_shardable
from engine.quant.config import detect
from engine.runner.encoder_runner import EncoderRunner
from engine.runner.model_runner import ModelRunner
from settings import child_environment

log = logging.getLogger(__name__)


def runner_for(config: EngineConfig, encoder: bool, pooling: bool):
    """LLMEngine's runner class (or factory of the same signature): the encoders', the decoders', or
    rank 0 of a tensor-parallel group."""
    if config.tensor_parallel_size == 1:
        return EncoderRunner if encoder else ModelRunner
    return tensor_parallel_runner(encoder, pooling)


def tensor_parallel_runner(encoder: bool, pooling: bool):
    """Rank 0's runner factory (ModelRunner's signature); refuses what cannot run sharded."""
    if encoder:
        raise ValueError("tensor_parallel_size > 1 is not supported for encoder models (BERT-style)")
    if pooling:
        raise ValueError("tensor_parallel_size > 1 is not supported for the pooling runner (embeddings)")
    return start_rank0


def refuse_unsharded_features(config: EngineConfig, model_config: ModelConfig) -> None:
    """LoRA adapters, quantized checkpoints and image inputs are not split across ranks (yet): say so."""
    if config.enable_lora:
        raise ValueError("tensor_parallel_size > 1 is not supported with LoRA adapters (enable_lora)")
    if config.quantization or detect(read_config(model_config.path), None) is not None:
        raise ValueError("tensor_parallel_size > 1 is not supported for quantized checkpoints")
    if multimodal_family(model_config.multimodal) is not None:
        raise ValueError("tensor_parallel_size > 1 is not supported for image-text models")


def start_rank0(
    config: EngineConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> TensorParallelRunner:
    world = config.tensor_parallel_size
    check_shardable(model_config, world)
    refuse_unsharded_features(config, model_config)
    joined = joined_from_env(world)
    if joined is not None:
        rank, addr, port = joined
        if rank != 0:
            raise ValueError(
                f"this process is RANK={rank}: the engine runs on rank 0; start the other ranks "
                "with `python -m engine.parallel.rank_main`"
            )
        procs = []
    else:
        addr, port = "127.0.0.1", free_port()
        spec = base64.b64encode(pickle.dumps((config, model_config, str(device), dtype))).decode()
        procs = [_start_rank(rank, world, addr, port, spec) for rank in range(1, world)]
    try:
        group = init_group(0, world, addr, port, rank_device(device, 0))
        runner = TensorParallelRunner(config, model_config, group.device, dtype, group)
    except BaseException:
        _stop(procs)
        destroy_group()
        raise
    stopping = threading.Event()

    def close():
        stopping.set()
        _stop(procs)
        destroy_group()

    runner.on_close = close
    runner.dead_ranks = lambda: _dead(procs, wait_s=2.0)
    atexit.register(runner.close)
    if procs:
        threading.Thread(target=_watch, args=(runner, procs, stopping), name="tp-watchdog", daemon=True).start()
    return runner


def _start_rank(rank: int, world: int, addr: str, port: int, spec: str) -> subprocess.Popen:
    env = child_environment(
        {"MASTER_ADDR": addr, "MASTER_PORT": str(port), "WORLD_SIZE": str(world), "RANK": str(rank)}
    )
    cmd = [sys.executable, "-m", "engine.parallel.rank_main", "--spec", spec, "--parent", str(os.getpid())]
    return subprocess.Popen(cmd, env=env)


def _dead(procs: list[subprocess.Popen], wait_s: float = 0.0) -> list[str]:
    """The started ranks that have exited, in words; with `wait_s`, waits that long for one (a collective
    sees a dead peer's sockets close a moment before its exit status can be read)."""
    deadline = time.monotonic() + wait_s
    while True:
        dead = [
            f"rank {rank} (pid {proc.pid}) exited with status {proc.returncode}"
            for rank, proc in enumerate(procs, 1)
            if proc.poll() is not None
        ]
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.05)


def _watch(runner: TensorParallelRunner, procs: list[subprocess.Popen], stopping: threading.Event) -> None:
    while not stopping.wait(0.2):
        dead = _dead(procs)
        if dead and not stopping.is_set():
            runner.rank_failed("; ".join(dead))
            return


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
