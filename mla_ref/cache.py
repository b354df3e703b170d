"""The paged latent KV cache: allocation, writes by slot mapping, and explicit page gathers.

Two layouts (docs/design.md, "The op contract"):

- floating: ``[num_blocks, page_size, 1, d_qk]`` (bf16 / fp16 / fp32; fp64 accepted for
  exact oracles), one latent+rope row per token;
- FP8: uint8 ``[num_blocks, page_size, spec.fp8_bytes_per_token]`` (see ``mla_ref.fp8``).

A token's global slot is ``block * page_size + offset``.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .fp8 import dequantize_kv_fp8, quantize_kv_fp8
from .spec import ModelSpec

#: Floating cache dtypes; the FP8 cache is uint8.
CACHE_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
#: ``make_kv_cache``'s kv_dtype names ('fp32' is an addition for tight oracles).
KV_CACHE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.uint8}


def is_fp8_cache(kv_cache: torch.Tensor) -> bool:
    """True for the uint8 FP8 layout, False for a floating cache."""
    return kv_cache.dtype == torch.uint8


def check_kv_cache(kv_cache: torch.Tensor, *, spec: ModelSpec, name: str = "kv_cache") -> None:
    """Raise ValueError unless ``kv_cache`` has one of the two layouts for ``spec``."""
    if not isinstance(kv_cache, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dtype == torch.uint8:
        want = spec.fp8_bytes_per_token
        if kv_cache.dim() != 3 or kv_cache.shape[2] != want:
            raise ValueError(f"{name} (FP8, uint8) must be [num_blocks, page_size, fp8_bytes_per_token={want}], "
                             f"got shape {tuple(kv_cache.shape)}")
    elif kv_cache.dtype in CACHE_FLOAT_DTYPES:
        if kv_cache.dim() != 4 or kv_cache.shape[2] != 1 or kv_cache.shape[3] != spec.d_qk:
            raise ValueError(f"{name} must be [num_blocks, page_size, 1, d_qk={spec.d_qk}], "
                             f"got shape {tuple(kv_cache.shape)}")
    else:
        raise ValueError(f"{name} dtype must be uint8 (FP8 layout) or one of bf16/fp16/fp32/fp64, "
                         f"got {kv_cache.dtype}")
    if kv_cache.shape[1] <= 0:
        raise ValueError(f"{name} page_size (dim 1) must be positive, got {kv_cache.shape[1]}")


def make_kv_cache(spec: ModelSpec, num_blocks: int, page_size: int, kv_dtype: str = "bf16",
                  device: Union[str, torch.device] = "cpu", fill: Optional[float] = None) -> torch.Tensor:
    """Allocate a paged cache.

    Args:
        kv_dtype: ``'bf16' | 'fp16' | 'fp8'`` (``'fp32'`` also accepted).
        fill: value every element reads back as (rounded to the format; ``nan`` poisons:
            an FP8 token filled with NaN dequantises to all-NaN). ``None`` = zeros.
    Returns:
        floating ``[num_blocks, page_size, 1, d_qk]`` or uint8 ``[num_blocks, page_size, fp8_bytes_per_token]``.
    """
    if kv_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_dtype must be one of {tuple(KV_CACHE_DTYPES)}, got {kv_dtype!r}")
    for name, value in (("num_blocks", num_blocks), ("page_size", page_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if kv_dtype != "fp8":
        shape = (num_blocks, page_size, 1, spec.d_qk)
        dtype = KV_CACHE_DTYPES[kv_dtype]
        if fill is None:
            return torch.zeros(shape, dtype=dtype, device=device)
        return torch.full(shape, float(fill), dtype=dtype, device=device)
    shape = (num_blocks, page_size, spec.fp8_bytes_per_token)
    if fill is None:
        # all-zero bytes decode to 0 * 0 = 0 for every value: a valid empty token
        return torch.zeros(shape, dtype=torch.uint8, device=device)
    latent = torch.full((spec.kv_lora_rank,), float(fill), dtype=torch.float32, device=device)
    rope = torch.full((spec.qk_rope_head_dim,), float(fill), dtype=torch.float32, device=device)
    token = quantize_kv_fp8(latent, rope, spec=spec)
    return token.expand(shape).clone()


def write_kv_cache(kv_cache: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor,
                   slot_mapping: torch.Tensor, *, spec: ModelSpec) -> None:
    """Write token rows into the cache in place (FP8 caches quantise on write).

    Args:
        kv_cache: floating ``[num_blocks, page_size, 1, d_qk]`` or uint8 ``[num_blocks, page_size, fp8_bytes]``.
        latent: ``[T, kv_lora_rank]`` float.
        rope: ``[T, qk_rope_head_dim]`` float.
        slot_mapping: int64 ``[T]`` global slots ``block * page_size + offset``; ``-1`` = skip
            the token (padding). Valid slots must be distinct (a real engine never writes
            one slot twice in a step, and the winner would be unspecified).
    """
    check_kv_cache(kv_cache, spec=spec)
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1:
        got = (f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}" if isinstance(slot_mapping, torch.Tensor)
               else type(slot_mapping).__name__)
        raise ValueError(f"slot_mapping must be int64 [T], got {got}")
    T = slot_mapping.shape[0]
    for name, t, width in (("latent", latent, spec.kv_lora_rank), ("rope", rope, spec.qk_rope_head_dim)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got "
                             f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if tuple(t.shape) != (T, width):
            raise ValueError(f"{name} must be [T={T}, {width}], got {tuple(t.shape)}")
    num_blocks, page_size = kv_cache.shape[0], kv_cache.shape[1]
    n_slots = num_blocks * page_size
    slots = slot_mapping.to("cpu")
    bad = (slots < -1) | (slots >= n_slots)
    if bool(bad.any()):
        raise ValueError(f"slot_mapping entries must be -1 or in [0, num_blocks*page_size={n_slots}), "
                         f"got {int(slots[bad][0])}")
    keep = slots >= 0
    valid = slots[keep]
    if valid.unique().numel() != valid.numel():
        raise ValueError("slot_mapping has a repeated slot (each valid slot may be written once per call)")
    if valid.numel() == 0:
        return
    keep_dev = keep.to(latent.device)
    blocks = (valid // page_size).to(kv_cache.device)
    offsets = (valid % page_size).to(kv_cache.device)
    lat, rp = latent[keep_dev].to(kv_cache.device), rope[keep_dev].to(kv_cache.device)
    # advanced-index assignment writes through any strides, so a non-contiguous cache view
    # is updated in place rather than through a silent reshape copy
    if is_fp8_cache(kv_cache):
        kv_cache[blocks, offsets] = quantize_kv_fp8(lat, rp, spec=spec)
    else:
        kv_cache[blocks, offsets, 0] = torch.cat([lat, rp], dim=-1).to(kv_cache.dtype)


def read_slots(kv_cache: torch.Tensor, slots: torch.Tensor, *, spec: ModelSpec,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Key rows at global slots (dequantised for FP8).

    Args:
        slots: int ``[n]`` global slots, each in ``[0, num_blocks*page_size)`` (not checked here).
    Returns:
        ``[n, d_qk]`` of ``dtype``.
    """
    page_size = kv_cache.shape[1]
    slots = slots.to(device=kv_cache.device, dtype=torch.int64)
    rows = kv_cache[slots // page_size, slots % page_size]
    if is_fp8_cache(kv_cache):
        return dequantize_kv_fp8(rows, spec=spec, dtype=dtype)
    return rows[:, 0].to(dtype)


def gather_kv(kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int, *, spec: ModelSpec,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The first ``seq_len`` tokens of one request, gathered page by page.

    Only the first ``ceil(seq_len / page_size)`` entries of ``block_table_row`` are read;
    later entries may hold anything.

    Args:
        kv_cache: either cache layout.
        block_table_row: int ``[max_blocks]`` physical page of each logical page.
        seq_len: tokens to gather, ``>= 0``.
        dtype: output dtype (fp32 by default; fp64 for exact oracles).
    Returns:
        ``[seq_len, d_qk]`` of ``dtype`` (FP8 tokens dequantised).
    """
    check_kv_cache(kv_cache, spec=spec)
    seq_len = int(seq_len)
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len}")
    if not isinstance(block_table_row, torch.Tensor) or block_table_row.dim() != 1:
        raise ValueError(f"block_table_row must be a 1-D tensor [max_blocks], got "
                         f"{tuple(block_table_row.shape) if isinstance(block_table_row, torch.Tensor) else type(block_table_row).__name__}")
    num_blocks, page_size = kv_cache.shape[0], kv_cache.shape[1]
    n_pages = -(-seq_len // page_size)
    if n_pages > block_table_row.shape[0]:
        raise ValueError(f"seq_len {seq_len} needs {n_pages} pages of {page_size} but block_table_row has "
                         f"{block_table_row.shape[0]} entries")
    pages = block_table_row[:n_pages].to(device=kv_cache.device, dtype=torch.int64)
    bad = (pages < 0) | (pages >= num_blocks)
    if bool(bad.any()):
        raise ValueError(f"block_table_row entries for the {n_pages} needed pages must be in "
                         f"[0, num_blocks={num_blocks}), got {int(pages[bad][0])}")
    rows = kv_cache[pages].reshape(n_pages * page_size, kv_cache.shape[-1])[:seq_len]
    if is_fp8_cache(kv_cache):
        return dequantize_kv_fp8(rows, spec=spec, dtype=dtype)
    return rows.to(dtype)
