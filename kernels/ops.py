"""The kernels as ``torch.library`` custom ops (namespace ``mla_fuzz``).

Registering them makes every launch one dispatched op with its mutated arguments declared,
so dispatch-level tooling (the harness's graph emulator, FakeTensor tracing, torch.compile)
sees what each launch reads and writes. Each op checks its contract at entry — dtype,
shape, device and *contiguity* (the kernels index flat) — and raises ValueError naming
the argument. The fake impls run the same checks and touch no data.

All ops return nothing: results go into caller-provided buffers, as in a graph-captured
engine where outputs live in persistent or pool memory.

Cache layouts: floating ``[nb, page, 1, d_qk]`` (bf16/fp16/fp32), FlashMLA's FP8 uint8
``[nb, page, fp8_bytes]`` and the per-tensor fp8_e4m3 float8_e4m3fn ``[nb, page, 1, d_qk]``.
The ops reading or writing an fp8_e4m3 cache take its scale as ``k_scale``, an fp32 ``[1]``
tensor on the cache's device that the kernels load when they run (so a captured graph
follows in-place updates of it); it is refused for the other layouts.
"""
from __future__ import annotations

from typing import Optional

import torch

from .cache_write import launch_cache_write
from .checks import check_device, check_tensor
from .combine import launch_combine
from .config import KERNEL_NAMES, interpreting
from .decode_sparse import launch_decode_sparse
from .planner import launch_planner
from .routes import launch_decode

__all__ = ["write_kv_cache", "plan", "decode_split", "decode_sparse", "combine"]

_I32 = (torch.int32,)
_F32 = (torch.float32,)
_FLOAT = (torch.bfloat16, torch.float16, torch.float32)
_Q = (torch.bfloat16, torch.float16, torch.float32)


def _fp8_bytes(rank: int, rope_dim: int, fp8_group: int) -> int:
    return rank + 4 * (rank // fp8_group) + 2 * rope_dim


def _check_cache(kv_cache: torch.Tensor, rank: int, rope_dim: int, fp8_group: int, k_scale=None) -> None:
    if not isinstance(kv_cache, torch.Tensor):
        raise ValueError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dtype == torch.float8_e4m3fn:
        check_tensor("kv_cache", kv_cache, dtypes=(torch.float8_e4m3fn,), shape=(None, None, 1, rank + rope_dim),
                     shape_text=f"[num_blocks, page_size, 1, d_qk={rank + rope_dim}] (fp8_e4m3)")
        if k_scale is None:
            raise ValueError("k_scale is required for an fp8_e4m3 kv_cache (float8_e4m3fn): an fp32 [1] tensor on "
                             "the cache's device")
        check_tensor("k_scale", k_scale, dtypes=_F32, shape=(1,), shape_text="[1] fp32 (the cache's scale)")
    elif k_scale is not None:
        raise ValueError(f"k_scale is only for an fp8_e4m3 (float8_e4m3fn) kv_cache, got a {kv_cache.dtype} cache")
    elif kv_cache.dtype == torch.uint8:
        nbytes = _fp8_bytes(rank, rope_dim, fp8_group)
        check_tensor("kv_cache", kv_cache, dtypes=(torch.uint8,), shape=(None, None, nbytes),
                     shape_text=f"[num_blocks, page_size, fp8_bytes_per_token={nbytes}] (FP8)")
    else:
        check_tensor("kv_cache", kv_cache, dtypes=_FLOAT, shape=(None, None, 1, rank + rope_dim),
                     shape_text=f"[num_blocks, page_size, 1, d_qk={rank + rope_dim}]")
    if kv_cache.shape[0] == 0 or kv_cache.shape[1] == 0:
        raise ValueError(f"kv_cache must have at least one page of one slot, got shape {tuple(kv_cache.shape)}")


# --------------------------------------------------------------------------- cache write

def _check_write(kv_cache, latent, rope, slot_mapping, rank, rope_dim, fp8_group, k_scale=None):
    _check_cache(kv_cache, rank, rope_dim, fp8_group, k_scale)
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), shape=(None,), shape_text="[T] int64")
    T = slot_mapping.shape[0]
    check_tensor("latent", latent, dtypes=_FLOAT, shape=(T, rank), shape_text=f"[T={T}, kv_lora_rank={rank}]")
    check_tensor("rope", rope, dtypes=_FLOAT, shape=(T, rope_dim), shape_text=f"[T={T}, rope={rope_dim}]")
    check_device(kv_cache.device, latent=latent, rope=rope, slot_mapping=slot_mapping, k_scale=k_scale)


@torch.library.custom_op("mla_fuzz::write_kv_cache", mutates_args=("kv_cache",))
def write_kv_cache(kv_cache: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, slot_mapping: torch.Tensor,
                   rank: int, rope_dim: int, fp8_group: int, k_scale: Optional[torch.Tensor] = None) -> None:
    """Write ``latent [T, rank]`` + ``rope [T, rope_dim]`` rows at ``slot_mapping`` (int64 ``[T]``,
    -1 = skip) into ``kv_cache`` (floating ``[nb, page, 1, d_qk]``, FP8 uint8 ``[nb, page, fp8_bytes]``
    or fp8_e4m3 ``[nb, page, 1, d_qk]``, the FP8 ones quantised on write; fp8_e4m3 with
    ``k_scale`` fp32 ``[1]``, saturating at +-448). All contiguous."""
    _check_write(kv_cache, latent, rope, slot_mapping, rank, rope_dim, fp8_group, k_scale)
    launch_cache_write(kv_cache, latent, rope, slot_mapping, rank=rank, rope_dim=rope_dim, group=fp8_group,
                       k_scale=k_scale)


@write_kv_cache.register_fake
def _write_kv_cache_fake(kv_cache, latent, rope, slot_mapping, rank, rope_dim, fp8_group, k_scale=None) -> None:
    _check_write(kv_cache, latent, rope, slot_mapping, rank, rope_dim, fp8_group, k_scale)


# --------------------------------------------------------------------------- planner

def _check_plan_buffers(part_info, num_splits, split_offsets, n: int, n_text: str) -> None:
    """The plan the planner writes and the decode/combine read: part_info int32
    ``[num_parts + 1, 3]`` (>= 2 rows), num_splits / split_offsets int32 ``[n]`` (``n_text``
    names n in messages, e.g. ``B=4``)."""
    check_tensor("part_info", part_info, dtypes=_I32, shape=(None, 3), shape_text="[num_parts + 1, 3] int32")
    if part_info.shape[0] < 2:
        raise ValueError(f"part_info must have num_parts + 1 >= 2 rows, got {tuple(part_info.shape)}")
    check_tensor("num_splits", num_splits, dtypes=_I32, shape=(n,), shape_text=f"[{n_text}] int32")
    check_tensor("split_offsets", split_offsets, dtypes=_I32, shape=(n,), shape_text=f"[{n_text}] int32")


def _check_plan(cache_seqlens, part_info, num_splits, split_offsets, block_n, min_tiles_per_part):
    check_tensor("cache_seqlens", cache_seqlens, dtypes=_I32, shape=(None,), shape_text="[B] int32")
    B = cache_seqlens.shape[0]
    _check_plan_buffers(part_info, num_splits, split_offsets, B, f"B={B}")
    if block_n < 1 or min_tiles_per_part < 1:
        raise ValueError(f"block_n and min_tiles_per_part must be >= 1, got {block_n}, {min_tiles_per_part}")
    check_device(cache_seqlens.device, part_info=part_info, num_splits=num_splits, split_offsets=split_offsets)


@torch.library.custom_op("mla_fuzz::plan", mutates_args=("part_info", "num_splits", "split_offsets"))
def plan(cache_seqlens: torch.Tensor, part_info: torch.Tensor, num_splits: torch.Tensor,
         split_offsets: torch.Tensor, block_n: int, min_tiles_per_part: int) -> None:
    """Plan the split-KV partition on the device (see ``kernels.planner``).

    ``cache_seqlens`` int32 ``[B]`` -> ``part_info`` int32 ``[num_parts + 1, 3]``,
    ``num_splits`` / ``split_offsets`` int32 ``[B]`` (all contiguous, written in place)."""
    _check_plan(cache_seqlens, part_info, num_splits, split_offsets, block_n, min_tiles_per_part)
    launch_planner(cache_seqlens, part_info, num_splits, split_offsets, block_n=block_n,
                   min_tiles_per_part=min_tiles_per_part)


@plan.register_fake
def _plan_fake(cache_seqlens, part_info, num_splits, split_offsets, block_n, min_tiles_per_part) -> None:
    _check_plan(cache_seqlens, part_info, num_splits, split_offsets, block_n, min_tiles_per_part)


# --------------------------------------------------------------------------- decode

def _check_decode(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits,
                  split_offsets, out, lse, partial_o, partial_lse, rank, rope_dim, fp8_group, kernel="triton",
                  k_scale=None):
    if kernel not in KERNEL_NAMES:
        raise ValueError(f"kernel must be one of {KERNEL_NAMES}, got {kernel!r}")
    check_tensor("q", q, dtypes=_Q, shape=(None, None, None, rank + rope_dim),
                 shape_text=f"[B, s_q, h_q, d_qk={rank + rope_dim}]")
    B, s_q, h, _ = q.shape
    rows = s_q * h
    _check_cache(kv_cache, rank, rope_dim, fp8_group, k_scale)
    check_tensor("block_table", block_table, dtypes=_I32, shape=(B, None), shape_text=f"[B={B}, max_blocks] int32")
    check_tensor("cache_seqlens", cache_seqlens, dtypes=_I32, shape=(B,), shape_text=f"[B={B}] int32")
    check_tensor("ctx_lens", ctx_lens, dtypes=_I32, shape=(B, None), shape_text=f"[B={B}, max_decode_len] int32")
    if ctx_lens.shape[1] > s_q:
        raise ValueError(f"ctx_lens width (max_decode_len) must be <= s_q={s_q}, got {tuple(ctx_lens.shape)}")
    check_tensor("ctx_width", ctx_width, dtypes=_I32, shape=(1,), shape_text="[1] int32")
    _check_plan_buffers(part_info, num_splits, split_offsets, B, f"B={B}")
    check_tensor("out", out, dtypes=(q.dtype,), shape=(B, s_q, h, rank), shape_text=f"[B={B}, s_q={s_q}, h={h}, {rank}]")
    check_tensor("lse", lse, dtypes=_F32, shape=(B, h, s_q), shape_text=f"[B={B}, h={h}, s_q={s_q}] fp32")
    check_tensor("partial_o", partial_o, dtypes=_F32, shape=(None, rows, rank),
                 shape_text=f"[capacity, s_q*h={rows}, {rank}] fp32")
    check_tensor("partial_lse", partial_lse, dtypes=_F32, shape=(partial_o.shape[0], rows),
                 shape_text=f"[capacity={partial_o.shape[0]}, s_q*h={rows}] fp32")
    check_device(q.device, kv_cache=kv_cache, block_table=block_table, cache_seqlens=cache_seqlens,
                 ctx_lens=ctx_lens, ctx_width=ctx_width, part_info=part_info, num_splits=num_splits,
                 split_offsets=split_offsets, out=out, lse=lse, partial_o=partial_o, partial_lse=partial_lse,
                 k_scale=k_scale)


@torch.library.custom_op("mla_fuzz::decode_split",
                         mutates_args=("out", "lse", "partial_o", "partial_lse"))
def decode_split(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                 ctx_lens: torch.Tensor, ctx_width: torch.Tensor, part_info: torch.Tensor, num_splits: torch.Tensor,
                 split_offsets: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, partial_o: torch.Tensor,
                 partial_lse: torch.Tensor, softmax_scale: float, rank: int, rope_dim: int, fp8_group: int,
                 block_m: int, block_n: int, num_warps: int, num_stages: int,
                 fp8_grouped: bool = True, kernel: str = "triton", k_scale: Optional[torch.Tensor] = None) -> None:
    """Split-KV decode over the plan in ``part_info`` / ``num_splits`` / ``split_offsets``,
    on the kernel ``routes.resolve`` picks from ``kernel`` (``DecodeConfig.kernel``).

    Reads q ``[B, s_q, h, d_qk]``, the paged cache, block_table int32 ``[B, max_blocks]``,
    cache_seqlens int32 ``[B]``, ctx_lens int32 ``[B, W]`` (visible keys per token; the
    kernel reads the width W from ``ctx_width`` int32 ``[1]`` on the device so a captured
    graph follows the current step's max_decode_len). Writes ``out`` / ``lse`` rows of
    unsplit requests and the fp32 partials of split ones; ``combine`` finishes the rest.
    An fp8_e4m3 cache needs ``k_scale`` (fp32 ``[1]``, loaded by the kernel: keys are
    ``e4m3 * k_scale``) and always runs on the portable Triton kernel (``routes.resolve``).
    """
    _check_decode(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits,
                  split_offsets, out, lse, partial_o, partial_lse, rank, rope_dim, fp8_group, kernel, k_scale)
    if q.shape[0] == 0:
        return
    launch_decode(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits, split_offsets,
                  out, lse, partial_o, partial_lse, softmax_scale=softmax_scale, rank=rank, rope_dim=rope_dim,
                  fp8_group=fp8_group, block_m=block_m, block_n=block_n, num_warps=num_warps,
                  num_stages=num_stages, fp8_grouped=fp8_grouped, kernel=kernel, k_scale=k_scale)


@decode_split.register_fake
def _decode_split_fake(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits,
                       split_offsets, out, lse, partial_o, partial_lse, softmax_scale, rank, rope_dim, fp8_group,
                       block_m, block_n, num_warps, num_stages, fp8_grouped=True, kernel="triton",
                       k_scale=None) -> None:
    _check_decode(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits,
                  split_offsets, out, lse, partial_o, partial_lse, rank, rope_dim, fp8_group, kernel, k_scale)


# --------------------------------------------------------------------------- sparse decode

def _check_decode_sparse(q, kv_cache, indices, row_start, row_len, part_info, num_splits, split_offsets, out,
                         lse_rows, partial_o, partial_lse, rank, rope_dim, fp8_group, k_scale=None):
    check_tensor("q", q, dtypes=_Q, shape=(None, None, None, rank + rope_dim),
                 shape_text=f"[B, s_q, h_q, d_qk={rank + rope_dim}]")
    B, s_q, h, _ = q.shape
    R = B * s_q
    _check_cache(kv_cache, rank, rope_dim, fp8_group, k_scale)
    check_tensor("indices", indices, dtypes=_I32, shape=(None,), shape_text="[N] int32 (flat top-k slots)")
    check_tensor("row_start", row_start, dtypes=_I32, shape=(R,), shape_text=f"[B*s_q={R}] int32")
    check_tensor("row_len", row_len, dtypes=_I32, shape=(R,), shape_text=f"[B*s_q={R}] int32")
    _check_plan_buffers(part_info, num_splits, split_offsets, R, f"B*s_q={R}")
    check_tensor("out", out, dtypes=(q.dtype,), shape=(B, s_q, h, rank), shape_text=f"[B={B}, s_q={s_q}, h={h}, {rank}]")
    check_tensor("lse_rows", lse_rows, dtypes=_F32, shape=(R, h), shape_text=f"[B*s_q={R}, h={h}] fp32")
    check_tensor("partial_o", partial_o, dtypes=_F32, shape=(None, h, rank), shape_text=f"[capacity, h={h}, {rank}] fp32")
    check_tensor("partial_lse", partial_lse, dtypes=_F32, shape=(partial_o.shape[0], h),
                 shape_text=f"[capacity={partial_o.shape[0]}, h={h}] fp32")
    check_device(q.device, kv_cache=kv_cache, indices=indices, row_start=row_start, row_len=row_len,
                 part_info=part_info, num_splits=num_splits, split_offsets=split_offsets, out=out, lse_rows=lse_rows,
                 partial_o=partial_o, partial_lse=partial_lse, k_scale=k_scale)


@torch.library.custom_op("mla_fuzz::decode_sparse",
                         mutates_args=("out", "lse_rows", "partial_o", "partial_lse"))
def decode_sparse(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, row_start: torch.Tensor,
                  row_len: torch.Tensor, part_info: torch.Tensor, num_splits: torch.Tensor,
                  split_offsets: torch.Tensor, out: torch.Tensor, lse_rows: torch.Tensor, partial_o: torch.Tensor,
                  partial_lse: torch.Tensor, softmax_scale: float, rank: int, rope_dim: int, fp8_group: int,
                  block_m: int, block_n: int, num_warps: int, num_stages: int,
                  k_scale: Optional[torch.Tensor] = None) -> None:
    """Sparse top-k decode over the plan in ``part_info`` / ``num_splits`` / ``split_offsets``
    (made by ``plan`` from ``row_len``), see ``kernels.decode_sparse``.

    Row ``r = b * s_q + i`` (query token i of request b) attends to the cache slots
    ``indices[row_start[r] : row_start[r] + row_len[r]]`` (int32 flat ``[N]``; ``-1`` masked).
    Writes unsplit rows of ``out [B, s_q, h, rank]`` / ``lse_rows`` fp32 ``[B*s_q, h]`` and the
    partials ``[cap, h, rank]`` / ``[cap, h]`` of split rows; ``combine`` over the
    ``[B*s_q, 1, h, rank]`` view finishes the rest. An fp8_e4m3 cache needs ``k_scale`` (fp32
    ``[1]``, loaded by the kernel).
    """
    _check_decode_sparse(q, kv_cache, indices, row_start, row_len, part_info, num_splits, split_offsets, out,
                         lse_rows, partial_o, partial_lse, rank, rope_dim, fp8_group, k_scale)
    if q.shape[0] == 0 or q.shape[1] == 0:
        return
    launch_decode_sparse(q, kv_cache, indices, row_start, row_len, part_info, num_splits, split_offsets, out,
                         lse_rows, partial_o, partial_lse, softmax_scale=softmax_scale, rank=rank,
                         rope_dim=rope_dim, fp8_group=fp8_group, block_m=block_m, block_n=block_n,
                         num_warps=num_warps, num_stages=num_stages,
                         dot_f32=interpreting() or q.dtype == torch.float32, k_scale=k_scale)


@decode_sparse.register_fake
def _decode_sparse_fake(q, kv_cache, indices, row_start, row_len, part_info, num_splits, split_offsets, out,
                        lse_rows, partial_o, partial_lse, softmax_scale, rank, rope_dim, fp8_group, block_m, block_n,
                        num_warps, num_stages, k_scale=None) -> None:
    _check_decode_sparse(q, kv_cache, indices, row_start, row_len, part_info, num_splits, split_offsets, out,
                         lse_rows, partial_o, partial_lse, rank, rope_dim, fp8_group, k_scale)


# --------------------------------------------------------------------------- combine

def _check_combine(partial_o, partial_lse, num_splits, split_offsets, out, lse, col_blocks=1):
    check_tensor("out", out, dtypes=_Q, shape=(None, None, None, None), shape_text="[B, s_q, h, rank]")
    B, s_q, h, rank = out.shape
    cols = rank // col_blocks if isinstance(col_blocks, int) and col_blocks >= 1 else 0
    if cols < 1 or cols * col_blocks != rank or cols & (cols - 1):
        raise ValueError(f"col_blocks must divide rank={rank} into power-of-two column blocks, "
                         f"got {col_blocks!r}")
    rows = s_q * h
    check_tensor("lse", lse, dtypes=_F32, shape=(B, h, s_q), shape_text=f"[B={B}, h={h}, s_q={s_q}] fp32")
    check_tensor("partial_o", partial_o, dtypes=_F32, shape=(None, rows, rank),
                 shape_text=f"[capacity, s_q*h={rows}, {rank}] fp32")
    check_tensor("partial_lse", partial_lse, dtypes=_F32, shape=(partial_o.shape[0], rows),
                 shape_text=f"[capacity={partial_o.shape[0]}, s_q*h={rows}] fp32")
    check_tensor("num_splits", num_splits, dtypes=_I32, shape=(B,), shape_text=f"[B={B}] int32")
    check_tensor("split_offsets", split_offsets, dtypes=_I32, shape=(B,), shape_text=f"[B={B}] int32")
    check_device(out.device, lse=lse, partial_o=partial_o, partial_lse=partial_lse, num_splits=num_splits,
                 split_offsets=split_offsets)


@torch.library.custom_op("mla_fuzz::combine", mutates_args=("out", "lse"))
def combine(partial_o: torch.Tensor, partial_lse: torch.Tensor, num_splits: torch.Tensor,
            split_offsets: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, block_m: int,
            col_blocks: int = 1) -> None:
    """Merge split requests' partials into ``out [B, s_q, h, rank]`` / ``lse`` fp32 ``[B, h, s_q]``
    and write 0 / -inf for requests with no keys (``num_splits == 0``); ``col_blocks``
    programs per row block share the latent columns (``rank / col_blocks`` a power of two)."""
    _check_combine(partial_o, partial_lse, num_splits, split_offsets, out, lse, col_blocks)
    launch_combine(partial_o, partial_lse, num_splits, split_offsets, out, lse, block_m=block_m,
                   col_blocks=col_blocks)


@combine.register_fake
def _combine_fake(partial_o, partial_lse, num_splits, split_offsets, out, lse, block_m, col_blocks=1) -> None:
    _check_combine(partial_o, partial_lse, num_splits, split_offsets, out, lse, col_blocks)

