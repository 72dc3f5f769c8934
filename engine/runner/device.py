"""Host<->device transfers that never stall the stream (inputs go up from pinned memory
asynchronously, and results come back in one wait), and zeroed buffers that cost nothing until used."""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A Python list (or CPU tensor) on `device` without waiting: staged in pinned memory
    and copied asynchronously on CUDA."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class PendingFetch:
    """Device tensors on their way to the host: the copies and an event are queued when it is made, so
    that `wait()` later waits for them alone, not for work queued since (async scheduling's next step)."""

    def __init__(self, tensors):
        self._done = None
        if all(t.device.type == "cpu" for t in tensors):
            self._host = tensors
            return
        self._host = [t.to("cpu", non_blocking=True) for t in tensors]  # pinned, asynchronous
        self._done = torch.cuda.Event()
        self._done.record()

    def wait(self) -> list[list]:
        """The tensors as Python lists."""
        if self._done is not None:
            self._done.synchronize()
        return [h.tolist() for h in self._host]


def fetch(*tensors: torch.Tensor) -> list[list]:
    """Device tensors as Python lists, with one wait for all of them together."""
    return PendingFetch(tensors).wait()


PAGE = 4096


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.zeros`, but on the CPU from `calloc` (through numpy): the kernel's zero pages are mapped when
    first touched, so a large KV pool costs nothing until its blocks are used (torch.zeros writes every
    page up front: a quarter of a second per GiB, on the critical path of every start)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    count = 1
    for size in shape:
        count *= size
    raw = torch.from_numpy(np.zeros(count * dtype.itemsize + PAGE, dtype=np.uint8))
    skip = -raw.data_ptr() % PAGE  # page-aligned: a row of a KV block never straddles two cache lines it need not
    return raw[skip : skip + count * dtype.itemsize].view(dtype).view(shape)
