"""PyTorch's current CUDA device, for shoal's defaults, without initializing CUDA.

A process that runs PyTorch on one GPU of several (a DDP rank on cuda:3 calls
``torch.cuda.set_device(3)``) expects what it makes without naming a device to land on
that GPU. Where the process never imported torch, or imported it without initializing
CUDA in it, nothing here imports torch or initializes CUDA: the caller keeps shoal's own
default device.
"""

from __future__ import annotations

import sys
from typing import Any, Optional


def torch_with_cuda() -> Any:
    """The torch module when this process imported it and initialized CUDA in it, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch if torch.cuda.is_initialized() else None
    except Exception:  # a torch without CUDA, or a stand-in module
        return None


def current_cuda_ordinal() -> Optional[int]:
    """``torch.cuda.current_device()`` where this process uses PyTorch on CUDA (see
    torch_with_cuda), else None."""
    torch = torch_with_cuda()
    if torch is None:
        return None
    try:
        return int(torch.cuda.current_device())
    except Exception:  # a stand-in module, or CUDA torn down at exit
        return None
