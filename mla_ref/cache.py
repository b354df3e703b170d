"""The paged latent KV cache: allocation, writes by slot mapping, and explicit page gathers.

Three layouts (docs/design.md, "The op contract"):

- floating: ``[num_blocks, page_size, 1, d_qk]`` (bf16 / fp16 / fp32; fp64 accepted for
  exact oracles), one latent+rope row per token;
- FP8 (kv_dtype ``"fp8"``, FlashMLA's): uint8 ``[num_blocks, page_size, spec.fp8_bytes_per_token]``,
  the scales inside each token (see ``mla_ref.fp8``);
- FP8 per-tensor (kv_dtype ``"fp8_e4m3"``, vLLM / SGLang / FlashInfer's): float8_e4m3fn
  ``[num_blocks, page_size, 1, d_qk]``, the floating layout in e4m3 with one fp32 scale for
  the whole cache, ``k_scale``, which every reader and writer of it takes (``mla_ref.fp8_tensor``).

A token's global slot is ``block * page_size + offset``.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .fp8 import FP8_E4M3_MAX, dequantize_kv_fp8, quantize_kv_fp8
from .fp8_tensor import KScale, _dequantize, _quantize, _scale_on, check_k_scale
from .spec import ModelSpec

#: Floating cache dtypes; the FP8 caches are uint8 (FlashMLA's) and float8_e4m3fn (per-tensor).
CACHE_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
#: ``make_kv_cache``'s kv_dtype names ('fp32' is an addition for tight oracles).
KV_CACHE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.uint8,
                   "fp8_e4m3": torch.float8_e4m3fn}


def is_fp8_cache(kv_cache: torch.Tensor) -> bool:
    """True for FlashMLA's uint8 FP8 layout (kv_dtype ``"fp8"``), False for any other cache
    (the per-tensor ``"fp8_e4m3"`` one included: ``is_fp8_e4m3_cache``)."""
    return kv_cache.dtype == torch.uint8


def is_fp8_e4m3_cache(kv_cache: torch.Tensor) -> bool:
    """True for the per-tensor-scaled float8_e4m3fn layout (kv_dtype ``"fp8_e4m3"``)."""
    return kv_cache.dtype == torch.float8_e4m3fn


def check_scale_for(kv_cache: torch.Tensor, k_scale: Optional[KScale], *, name: str = "kv_cache") -> Optional[float]:
    """The validated scale of ``kv_cache``'s reads and writes, as a Python float (the fp32
    value), or None for a cache that has no per-tensor scale.

    ValueError when an fp8_e4m3 cache comes without ``k_scale``, when ``k_scale`` is not a
    positive finite fp32 scale, and when one is given for any other cache (it would be
    silently unused: the bf16/fp16 caches are unscaled and FlashMLA's FP8 token carries its
    own scales).
    """
    if is_fp8_e4m3_cache(kv_cache):
        if k_scale is None:
            raise ValueError(f"k_scale is required for an fp8_e4m3 {name} (float8_e4m3fn): its values are "
                             f"e4m3 * k_scale")
        return check_k_scale(k_scale)
    if k_scale is not None:
        raise ValueError(f"k_scale is only for an fp8_e4m3 (float8_e4m3fn) cache; {name} is {kv_cache.dtype}")
    return None


def _rows_to(rows: torch.Tensor, scale: Optional[float], *, spec: ModelSpec, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows (``[n, bytes]`` FP8 tokens, or ``[n, d_qk]`` of any other layout) as ``[n, d_qk]`` keys."""
    if rows.dtype == torch.uint8:
        return dequantize_kv_fp8(rows, spec=spec, dtype=dtype)
    if rows.dtype == torch.float8_e4m3fn:
        return _dequantize(rows, _scale_on(scale, rows.device), dtype)
    return rows.to(dtype)


def check_kv_cache(kv_cache: torch.Tensor, *, spec: ModelSpec, name: str = "kv_cache") -> None:
    """Raise ValueError unless ``kv_cache`` has one of the three layouts for ``spec`` (module doc)."""
    if not isinstance(kv_cache, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dtype == torch.uint8:
        want = spec.fp8_bytes_per_token
        if kv_cache.dim() != 3 or kv_cache.shape[2] != want:
            raise ValueError(f"{name} (FP8, uint8) must be [num_blocks, page_size, fp8_bytes_per_token={want}], "
                             f"got shape {tuple(kv_cache.shape)}")
    elif kv_cache.dtype in CACHE_FLOAT_DTYPES or kv_cache.dtype == torch.float8_e4m3fn:
        if kv_cache.dim() != 4 or kv_cache.shape[2] != 1 or kv_cache.shape[3] != spec.d_qk:
            raise ValueError(f"{name} must be [num_blocks, page_size, 1, d_qk={spec.d_qk}], "
                             f"got shape {tuple(kv_cache.shape)}")
    else:
        raise ValueError(f"{name} dtype must be uint8 (FP8 layout), float8_e4m3fn (fp8_e4m3 layout) or one of "
                         f"bf16/fp16/fp32/fp64, got {kv_cache.dtype}")
    if kv_cache.shape[1] <= 0:
        raise ValueError(f"{name} page_size (dim 1) must be positive, got {kv_cache.shape[1]}")


def make_kv_cache(spec: ModelSpec, num_blocks: int, page_size: int, kv_dtype: str = "bf16",
                  device: Union[str, torch.device] = "cpu", fill: Optional[float] = None) -> torch.Tensor:
    """Allocate a paged cache.

    Args:
        kv_dtype: ``'bf16' | 'fp16' | 'fp8' | 'fp8_e4m3'`` (``'fp32'`` also accepted).
        fill: value every element reads back as (rounded to the format; ``nan`` poisons:
            an FP8 token filled with NaN dequantises to all-NaN). For ``'fp8_e4m3'`` the value
            read back at ``k_scale = 1`` (saturated to +-448; NaN gives the NaN code).
            ``None`` = zeros.
    Returns:
        floating ``[num_blocks, page_size, 1, d_qk]`` (float8_e4m3fn for ``'fp8_e4m3'``) or uint8
        ``[num_blocks, page_size, fp8_bytes_per_token]``.
    """
    if kv_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_dtype must be one of {tuple(KV_CACHE_DTYPES)}, got {kv_dtype!r}")
    for name, value in (("num_blocks", num_blocks), ("page_size", page_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if kv_dtype == "fp8_e4m3":
        shape = (num_blocks, page_size, 1, spec.d_qk)
        if fill is None:
            return torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device)
        value = torch.full((), float(fill), dtype=torch.float32).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        code = int(value.to(torch.float8_e4m3fn).view(torch.uint8))
        return torch.full(shape, code, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
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
                   slot_mapping: torch.Tensor, *, spec: ModelSpec, k_scale: Optional[KScale] = None) -> None:
    """Write token rows into the cache in place (FP8 caches quantise on write).

    Args:
        kv_cache: floating ``[num_blocks, page_size, 1, d_qk]`` (float8_e4m3fn included) or uint8
            ``[num_blocks, page_size, fp8_bytes]``.
        latent: ``[T, kv_lora_rank]`` float.
        rope: ``[T, qk_rope_head_dim]`` float.
        slot_mapping: int64 ``[T]`` global slots ``block * page_size + offset``; ``-1`` = skip
            the token (padding). Valid slots must be distinct (a real engine never writes
            one slot twice in a step, and the winner would be unspecified).
        k_scale: the fp8_e4m3 cache's per-tensor scale (float or 1-element fp32 tensor):
            required for that cache (rows are stored as ``rne(clamp(x / k_scale, +-448))``,
            ``mla_ref.fp8_tensor``), refused for any other.
    """
    check_kv_cache(kv_cache, spec=spec)
    scale = check_scale_for(kv_cache, k_scale)
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
    elif is_fp8_e4m3_cache(kv_cache):
        codes = _quantize(torch.cat([lat.float(), rp.float()], dim=-1), _scale_on(scale, kv_cache.device))
        # through byte views: index_put on float8 tensors is not implemented on every backend
        kv_cache.view(torch.uint8)[blocks, offsets, 0] = codes.view(torch.uint8)
    else:
        kv_cache[blocks, offsets, 0] = torch.cat([lat, rp], dim=-1).to(kv_cache.dtype)


def read_slots(kv_cache: torch.Tensor, slots: torch.Tensor, *, spec: ModelSpec,
               dtype: torch.dtype = torch.float32, k_scale: Optional[KScale] = None) -> torch.Tensor:
    """Key rows at global slots (dequantised for FP8).

    Args:
        slots: int ``[n]`` global slots, each in ``[0, num_blocks*page_size)`` (not checked here).
        k_scale: the fp8_e4m3 cache's scale (required for it, refused otherwise; ``check_scale_for``).
    Returns:
        ``[n, d_qk]`` of ``dtype``.
    """
    scale = check_scale_for(kv_cache, k_scale)
    page_size = kv_cache.shape[1]
    slots = slots.to(device=kv_cache.device, dtype=torch.int64)
    rows = kv_cache[slots // page_size, slots % page_size]
    if not is_fp8_cache(kv_cache):
        rows = rows[:, 0]
    return _rows_to(rows, scale, spec=spec, dtype=dtype)


def gather_kv(kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int, *, spec: ModelSpec,
              dtype: torch.dtype = torch.float32, k_scale: Optional[KScale] = None) -> torch.Tensor:
    """The first ``seq_len`` tokens of one request, gathered page by page.

    Only the first ``ceil(seq_len / page_size)`` entries of ``block_table_row`` are read;
    later entries may hold anything.

    Args:
        kv_cache: any cache layout.
        block_table_row: int ``[max_blocks]`` physical page of each logical page.
        seq_len: tokens to gather, ``>= 0``.
        dtype: output dtype (fp32 by default; fp64 for exact oracles).
        k_scale: the fp8_e4m3 cache's scale (required for it, refused otherwise; ``check_scale_for``).
    Returns:
        ``[seq_len, d_qk]`` of ``dtype`` (FP8 tokens dequantised).
    """
    check_kv_cache(kv_cache, spec=spec)
    scale = check_scale_for(kv_cache, k_scale)
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
    return _rows_to(rows, scale, spec=spec, dtype=dtype)
