"""The ranks' process groups: the model's collectives on the device's backend (NCCL on a GPU, gloo on
the CPU) under a timeout, and a gloo group for rank 0's step messages, which a rank waits on while the
engine is idle (so without a deadline; a dead peer closes its sockets, which ends the wait at once)."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from settings import EngineSettings, current

IDLE_TIMEOUT = timedelta(days=30)  # the step messages' group: an idle engine may wait this long
ENV_VARS = {"master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT", "world_size": "WORLD_SIZE", "rank": "RANK"}


class TensorParallelError(RuntimeError):
    """A rank died or a collective failed: the group cannot go on, and nor can the engine."""

    fatal = True  # workers.engine_host ends the worker on it: its shards' leases expire and are retried


@dataclass
class RankGroup:
    rank: int
    world_size: int
    device: torch.device
    control: object  # the gloo group of rank 0's messages

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def collective_timeout() -> timedelta:
    return timedelta(seconds=current(EngineSettings).tp_timeout_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def joined_from_env(world_size: int) -> tuple[int, str, int] | None:
    """(rank, MASTER_ADDR, MASTER_PORT) where the environment describes the group this process is one
    rank of (multi-host), None where rank 0 starts the others itself; a WORLD_SIZE that disagrees with
    `world_size` is refused."""
    env = current(EngineSettings)
    if env.world_size is None or env.rank is None:
        return None
    missing = [var for name, var in ENV_VARS.items() if getattr(env, name) in (None, "")]
    if missing:
        raise ValueError(f"joining a tensor-parallel group needs {', '.join(ENV_VARS.values())}; missing {missing}")
    if env.world_size != world_size:
        raise ValueError(f"WORLD_SIZE={env.world_size} but tensor_parallel_size={world_size}")
    return env.rank, env.master_addr, env.master_port


def rank_device(device: torch.device, rank: int) -> torch.device:
    """One GPU per rank on its host (LOCAL_RANK when set, as torchrun sets it); the CPU for every rank."""
    if device.type != "cuda":
        return device
    local = current(EngineSettings).local_rank
    return torch.device("cuda", rank % max(torch.cuda.device_count(), 1) if local is None else local)


def init_group(rank: int, world_size: int, addr: str, port: int, device: torch.device) -> RankGroup:
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a torch.distributed group: one tensor-parallel engine per process"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=collective_timeout(),
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return RankGroup(rank, world_size, device, control)


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
