"""Run Megatron-core's mixed-precision optimizer on CPU tensors.

megatron.core.optimizer (0.16) is written for CUDA: it creates its scalar bookkeeping tensors with
`device='cuda'` and accepts only parameters whose `type()` is 'torch.cuda.BFloat16Tensor' etc.
Its arithmetic is device-agnostic torch. Under `cuda_as_cpu()` (used only when CUDA is absent),
factory calls asking for a CUDA device get the CPU, and `Tensor.type()` of a CPU tensor reads as
its CUDA name, so Megatron's own optimizer code runs unchanged on the gloo/CPU test machines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda(device: object) -> bool:
    return (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda"
    )


class _CudaAsCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_as_cpu() -> Iterator[None]:
    """No-op with CUDA; on CPU-only machines, the mapping described in the module docstring."""
    if torch.cuda.is_available():
        yield
        return
    with _CudaAsCpu():
        yield
