"""Peak memory of a training step, on CUDA and on the CPU, and what counts as out of memory.

    CUDA: torch.cuda.max_memory_allocated since the meter's last reset (the caching allocator's own figure;
          what an allocation failure is measured against)
    CPU:  parameters + gradients + optimiser state + the peak of the activations autograd holds for backward
          (saved_tensors_hooks, distinct storages, parameters excluded)

Why the CPU figure is not RSS: glibc keeps freed pages, 8 processes share the cores here, and a fresh process
per probe costs seconds of imports; the saved activations are what grows with the batch, and they are exact and
repeatable, so `tune`, the closed loop and their tests give the same numbers on every run. It leaves out
transient workspace (an op's temporaries freed before backward), so a CPU target is a model of memory, not a
guarantee against the kernel's OOM killer. Cost: one Python call per tensor saved for backward (a few hundred
per step), nothing on CUDA beyond a reset per step.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def is_oom(e: BaseException) -> bool:
    """torch.OutOfMemoryError, or the RuntimeError older kernels and backends raise ("... out of memory")."""
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "out of memory" in str(e))


def free_after_oom(device: torch.device) -> None:
    """Give the caching allocator's free blocks back after an OOM, so a smaller retry can get them."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Parameters, their gradients (counted whether allocated yet or not) and the optimiser's tensors."""
    n = sum(2 * p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    n += sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    if optimizer is not None:
        n += sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor) and t.dim() > 0)
    return n


class MemoryMeter:
    """Peak bytes of the steps run under `measure()`; `take()` returns the peak since the last take and resets."""

    def __init__(self, device: torch.device, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
        self.device, self.model, self.optimizer = device, model, optimizer
        self._peak = 0.0
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        """Around one forward (+ backward): on the CPU, counts the activations saved for backward."""
        if self.device.type == "cuda":
            yield
            return
        seen: set[int] = set()
        held = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr not in seen and ptr not in self._params:
                seen.add(ptr)
                held[0] += s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self._peak = max(self._peak, float(held[0] + state_bytes(self.model, self.optimizer)))

    def take(self) -> float:
        if self.device.type == "cuda":
            peak = float(torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
            return peak
        peak, self._peak = self._peak, 0.0
        return peak


def total_bytes(device: torch.device) -> int:
    """What the device has: CUDA total memory, or on the CPU the memory available now (MemAvailable)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
