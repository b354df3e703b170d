"""The FP8 KV-cache token format (FlashMLA's V3.2 layout, generalised to any ModelSpec).

One token is ``spec.fp8_bytes_per_token`` bytes (656 at DeepSeek size):

- bytes ``[0, rank)``: the latent as float8_e4m3fn, one byte per value;
- then ``rank // fp8_group`` float32 scales, 4 little-endian bytes each, one per group of
  ``fp8_group`` consecutive latent values;
- then ``qk_rope_head_dim`` bfloat16 rope values, 2 bytes each (rope stays 16-bit because
  its positional information does not survive 3 mantissa bits).

A group's scale is ``max(amax(group), FP8_AMAX_FLOOR) / 448`` and its stored values are
``clamp(x / scale, -448, 448)`` rounded to e4m3 (round to nearest even).
"""
from __future__ import annotations

import sys

import torch

from .spec import ModelSpec

#: Largest finite float8_e4m3fn value; a group's amax maps onto it.
FP8_E4M3_MAX = 448.0
#: Floor on a group's amax so an all-zero group gets a finite, *normal* fp32 scale
#: (2**-100 / 448 is still normal, so a flush-to-zero GPU kernel computes the same scale
#: instead of 0 and then 0/0 = NaN). A power of two so every language spells it exactly.
FP8_AMAX_FLOOR = 2.0 ** -100

# The scale bytes are defined as little-endian; ``Tensor.view`` reinterprets in host order.
if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("mla_fuzz.mla_ref.fp8 assumes a little-endian host (the FP8 cache layout is little-endian)")

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def ieee_div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor``, correctly rounded on every device.

    On CUDA, torch turns division by a Python scalar into multiplication by its rounded
    reciprocal (1/448 is inexact, so some scales come out one ulp off the CPU's); a 0-d
    tensor divisor on x's device takes the true-division kernel instead, so CPU, GPU and
    a kernel using div_rn all agree bit for bit.

    Returns:
        a tensor of x's shape, dtype and device.
    """
    return x / torch.full((), divisor, dtype=x.dtype, device=x.device)


def _check_float(name: str, t: torch.Tensor, width: int, width_name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be a floating tensor (fp16/bf16/fp32/fp64), got {t.dtype}")
    if t.dim() < 1 or t.shape[-1] != width:
        raise ValueError(f"{name} must have last dim {width_name}={width}, got shape {tuple(t.shape)}")


def quantize_kv_fp8(latent: torch.Tensor, rope: torch.Tensor, *, spec: ModelSpec) -> torch.Tensor:
    """Pack latent + rope rows into FP8 cache tokens.

    Args:
        latent: ``[..., kv_lora_rank]`` any float dtype.
        rope: ``[..., qk_rope_head_dim]`` any float dtype, same leading shape as ``latent``.
    Returns:
        uint8 ``[..., spec.fp8_bytes_per_token]`` on the inputs' device (layout in the module doc).
    """
    rank, rope_dim, group = spec.kv_lora_rank, spec.qk_rope_head_dim, spec.fp8_group
    _check_float("latent", latent, rank, "kv_lora_rank")
    _check_float("rope", rope, rope_dim, "qk_rope_head_dim")
    if latent.shape[:-1] != rope.shape[:-1]:
        raise ValueError(f"rope leading shape must match latent's {tuple(latent.shape[:-1])}, "
                         f"got {tuple(rope.shape[:-1])}")
    if latent.device != rope.device:
        raise ValueError(f"rope must be on latent's device {latent.device}, got {rope.device}")
    lead = latent.shape[:-1]
    groups = latent.float().reshape(*lead, rank // group, group)
    amax = groups.abs().amax(dim=-1)
    scale = ieee_div(amax.clamp_min(FP8_AMAX_FLOOR), FP8_E4M3_MAX)  # fp32 [..., G]
    # clamp before the cast: x/scale can land a rounding step above 448, and e4m3fn has
    # no infinity to saturate to (an out-of-range cast is implementation-defined).
    values = (groups / scale.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    fp8_bytes = values.to(torch.float8_e4m3fn).reshape(*lead, rank).view(torch.uint8)
    scale_bytes = scale.contiguous().view(torch.uint8)
    rope_bytes = rope.to(torch.bfloat16).contiguous().view(torch.uint8)
    return torch.cat([fp8_bytes, scale_bytes, rope_bytes], dim=-1)


def split_fp8_tokens(packed: torch.Tensor, *, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reinterpret FP8 cache tokens without converting them.

    Args:
        packed: uint8 ``[..., spec.fp8_bytes_per_token]``.
    Returns:
        ``(values float8_e4m3fn [..., rank], scales fp32 [..., rank // fp8_group],
        rope bf16 [..., qk_rope_head_dim])`` — copies, not views of ``packed``.
    """
    if not isinstance(packed, torch.Tensor):
        raise ValueError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    nbytes = spec.fp8_bytes_per_token
    if packed.dim() < 1 or packed.shape[-1] != nbytes:
        raise ValueError(f"packed must have last dim fp8_bytes_per_token={nbytes}, got shape {tuple(packed.shape)}")
    rank, n_groups = spec.kv_lora_rank, spec.kv_lora_rank // spec.fp8_group
    scale_end = rank + 4 * n_groups
    # .contiguous() because a dtype view of a byte slice needs a unit-stride last dim
    # whose storage offset is aligned to the wider type.
    values = packed[..., :rank].contiguous().view(torch.float8_e4m3fn)
    scales = packed[..., rank:scale_end].contiguous().view(torch.float32)
    rope = packed[..., scale_end:].contiguous().view(torch.bfloat16)
    return values, scales, rope


def dequantize_kv_fp8(packed: torch.Tensor, *, spec: ModelSpec, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpack FP8 cache tokens into latent-attention key rows.

    Args:
        packed: uint8 ``[..., spec.fp8_bytes_per_token]``.
        dtype: output dtype; the ``e4m3 * scale`` product is computed in it.
    Returns:
        ``[..., d_qk]`` of ``dtype``: dequantised latent (``e4m3 * scale``) then rope.
    """
    values, scales, rope = split_fp8_tokens(packed, spec=spec)
    lead = packed.shape[:-1]
    group = spec.fp8_group
    latent = values.to(dtype).reshape(*lead, spec.kv_lora_rank // group, group) * scales.to(dtype).unsqueeze(-1)
    return torch.cat([latent.reshape(*lead, spec.kv_lora_rank), rope.to(dtype)], dim=-1)
