"""Entry checks shared by the kernel wrappers: dtype, shape, device and contiguity.

Every kernel here indexes its tensors *flat* (base pointer + row * row_width), so a
non-contiguous view would be read at the wrong addresses without any error. The checks
turn that into a ``ValueError`` naming the argument, expected vs given.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .config import interpreting

__all__ = ["describe", "check_tensor", "check_device"]


def describe(t) -> str:
    """``dtype shape (strides)`` of a tensor, or the type name of anything else."""
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).replace('torch.', '')} {tuple(t.shape)} strides {tuple(t.stride())}"
    return type(t).__name__


def check_tensor(name: str, t, *, dtypes: Sequence[torch.dtype], shape: Optional[Sequence[Optional[int]]] = None,
                 shape_text: str = "", contiguous: bool = True) -> None:
    """Raise ValueError unless ``t`` is a tensor of one of ``dtypes`` with ``shape`` (None =
    any size in that dim) and, when ``contiguous``, a contiguous layout."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in tuple(dtypes):
        want = "/".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must have dtype {want}, got {describe(t)}")
    if shape is not None:
        ok = t.dim() == len(shape) and all(w is None or g == w for g, w in zip(t.shape, shape))
        if not ok:
            want = tuple("*" if w is None else w for w in shape)
            raise ValueError(f"{name} must have shape {shape_text or want}, got {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the kernel indexes it flat), got {describe(t)}; "
                         f"pass a contiguous buffer (a .contiguous() copy would break graph address stability)")


def check_device(device: torch.device, **tensors) -> None:
    """All tensors on ``device``; CUDA, or CPU only under the Triton interpreter."""
    if device.type == "cpu":
        if not interpreting():
            raise ValueError("the Triton kernels need CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set "
                             "before triton is imported")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensors must be on CUDA (or CPU under the interpreter), got {device}")
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} must be on {device}, got {t.device}")
