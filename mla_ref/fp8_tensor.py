"""The per-tensor-scaled FP8 KV cache (kv_dtype ``"fp8_e4m3"``), as vLLM's, SGLang's and
FlashInfer's MLA backends keep it.

One token is ``d_qk`` float8_e4m3fn values -- the latent then the rope, *all* e4m3 -- and the
whole layer shares ONE fp32 scale ``k_scale``, held by the engine in a device tensor
(``DecodeBatch.k_scale``):

- dequantise: ``value = e4m3 * k_scale`` (the product in the output dtype; fp32 by default);
- quantise: ``e4m3 = rne(clamp(x / k_scale, -448, 448))``, the division in fp32 (correctly
  rounded on every device), the clamp being e4m3fn's saturation (it has no infinity), the
  rounding torch's cast (round to nearest even, subnormals included).

e4m3fn has NaN codes (0x7F / 0xFF) and no infinity: a NaN input stores a NaN code and a NaN
code (the harness poisons pages with 0xFF bytes) dequantises to NaN at any scale; +-inf
inputs saturate to +-448.

Unlike FlashMLA's 656-byte token (``mla_ref.fp8``), nothing about the scale lives in the cache:
reading the cache needs the scale, so every reader takes ``k_scale``.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .fp8 import FP8_E4M3_MAX

__all__ = ["check_k_scale", "quantize_kv_fp8_e4m3", "dequantize_kv_fp8_e4m3"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

KScale = Union[float, torch.Tensor]


def check_k_scale(k_scale: KScale, *, name: str = "k_scale") -> float:
    """Validate a per-tensor scale and return it as the Python float of its fp32 value.

    Args:
        k_scale: a Python float (rounded to fp32 here) or a 1-element fp32 tensor on any
            device (read to the host: not for capture-time use).
    Returns:
        the fp32 value as a Python float. ValueError unless it is positive and finite in fp32.
    """
    if isinstance(k_scale, torch.Tensor):
        if k_scale.dtype != torch.float32 or k_scale.numel() != 1:
            raise ValueError(f"{name} must be a 1-element fp32 tensor, got {k_scale.dtype} {tuple(k_scale.shape)}")
        value = float(k_scale.detach().reshape(()).cpu())
    elif isinstance(k_scale, (int, float)) and not isinstance(k_scale, bool):
        # the scale the kernels see is fp32: 1e-50 or 1e39 would silently become 0 or inf there
        value = float(torch.tensor(float(k_scale), dtype=torch.float32))
    else:
        raise ValueError(f"{name} must be a float or a 1-element fp32 tensor, got {type(k_scale).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite fp32 scale, got {value!r}")
    return value


def _scale_on(value: KScale, device: torch.device) -> torch.Tensor:
    """The scale as a 0-d fp32 tensor on ``device``: a tensor divisor on the operand's device
    takes torch's true-division kernel, where a Python scalar would become a multiplication
    by its rounded reciprocal on CUDA (see ``fp8.ieee_div``)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.full((), float(value), dtype=torch.float32, device=device)


def _check_float(name: str, t, width: Optional[int] = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be a floating tensor (fp16/bf16/fp32/fp64), got {t.dtype}")
    if t.dim() < 1 or (width is not None and t.shape[-1] != width):
        raise ValueError(f"{name} must have last dim {width}, got shape {tuple(t.shape)}")


def _quantize(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 rows / 0-d fp32 scale on their device -> e4m3 (no checks)."""
    # clamp before the cast: e4m3fn has no infinity, so an out-of-range cast is
    # implementation-defined; the clamp keeps NaN, which casts to a NaN code
    return (rows / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def _dequantize(rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 rows times a 0-d fp32 scale on their device, in ``dtype`` (no checks, no host read)."""
    return rows.to(dtype) * scale.to(dtype)


def quantize_kv_fp8_e4m3(latent: torch.Tensor, rope: torch.Tensor, k_scale: KScale) -> torch.Tensor:
    """Quantise latent + rope rows into fp8_e4m3 cache rows with one per-tensor scale.

    Args:
        latent: ``[T, kv_lora_rank]`` (or any ``[..., rank]``) fp16/bf16/fp32/fp64.
        rope: ``[T, qk_rope_head_dim]`` with latent's leading shape and device.
        k_scale: the layer's scale, a float or 1-element fp32 tensor (validated: positive, finite).
    Returns:
        float8_e4m3fn ``[T, rank + rope]`` on the inputs' device:
        ``rne(clamp(fp32(x) / k_scale, -448, 448))`` (module doc).
    """
    _check_float("latent", latent)
    _check_float("rope", rope)
    if latent.shape[:-1] != rope.shape[:-1]:
        raise ValueError(f"rope leading shape must match latent's {tuple(latent.shape[:-1])}, "
                         f"got {tuple(rope.shape[:-1])}")
    if latent.device != rope.device:
        raise ValueError(f"rope must be on latent's device {latent.device}, got {rope.device}")
    scale = check_k_scale(k_scale)
    rows = torch.cat([latent.float(), rope.float()], dim=-1)
    return _quantize(rows, _scale_on(scale, rows.device))


def dequantize_kv_fp8_e4m3(rows: torch.Tensor, k_scale: KScale, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantise fp8_e4m3 cache rows.

    Args:
        rows: float8_e4m3fn ``[..., d_qk]`` (any shape; a cache ``[nb, ps, 1, d_qk]`` too).
        k_scale: the layer's scale, a float or 1-element fp32 tensor (validated: positive, finite).
        dtype: output dtype; the ``e4m3 * k_scale`` product is computed in it (exact in fp64).
    Returns:
        ``rows``' shape in ``dtype`` on rows' device; NaN codes give NaN.
    """
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.float8_e4m3fn:
        got = rows.dtype if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise ValueError(f"rows must be a float8_e4m3fn tensor, got {got}")
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be fp16/bf16/fp32/fp64, got {dtype}")
    scale = check_k_scale(k_scale)
    return _dequantize(rows, _scale_on(scale, rows.device), dtype)
