"""The top-k selector ("indexer") on the device, as the ``mla_fuzz::indexer_topk`` custom op.

Same selection as ``mla_ref.indexer_topk`` (read its doc for the scoring), computed with
fixed-size tensor ops so it can live inside a captured graph: every request's whole
block-table span (``max_blocks * page_size`` positions) is scored, invisible positions
(beyond the token's context length, read from the flat context-lens buffer) are set to
``-inf`` with ``torch.where`` (so NaN in poisoned pages or padded queries cannot leak), a
stable descending sort picks the top ``topk``, and masked picks become ``-1``. No host
sync, no data-dependent shapes.

Being a registered op makes its inputs visible to the harness's contiguity audit: the
context lengths must be a contiguous ``[B, W]`` tensor (vLLM #42135: the indexer read a
non-contiguous ``[:B, :max_decode_len]`` view of a 2-D ``[max_seqs, next_n]`` buffer).
"""
from __future__ import annotations

from typing import Optional

import torch

from mla_fuzz.mla_ref.fp8 import dequantize_kv_fp8

from .checks import check_device, check_tensor
from .decode import token_context

__all__ = ["indexer_topk"]

_F32 = (torch.float32,)
_I32 = (torch.int32,)


def _check(q, kv_cache, block_table, ctx_lens, ctx_width, w_q, w_k, head_w, out_indices, topk, rank, rope_dim, fp8_group,
           k_scale=None):
    check_tensor("q", q, dtypes=(torch.bfloat16, torch.float16, torch.float32), shape=(None, None, None, rank + rope_dim),
                 shape_text=f"[B, s_q, h, d_qk={rank + rope_dim}]")
    B, s_q, h, d = q.shape
    if kv_cache.dtype == torch.float8_e4m3fn:
        check_tensor("kv_cache", kv_cache, dtypes=(torch.float8_e4m3fn,), shape=(None, None, 1, d),
                     shape_text=f"[num_blocks, page_size, 1, d_qk={d}] (fp8_e4m3)")
        if k_scale is None:
            raise ValueError("k_scale is required for an fp8_e4m3 kv_cache (float8_e4m3fn): an fp32 [1] tensor")
        check_tensor("k_scale", k_scale, dtypes=_F32, shape=(1,), shape_text="[1] fp32 (the cache's scale)")
    elif k_scale is not None:
        raise ValueError(f"k_scale is only for an fp8_e4m3 (float8_e4m3fn) kv_cache, got a {kv_cache.dtype} cache")
    elif kv_cache.dtype == torch.uint8:
        nbytes = rank + 4 * (rank // fp8_group) + 2 * rope_dim
        check_tensor("kv_cache", kv_cache, dtypes=(torch.uint8,), shape=(None, None, nbytes),
                     shape_text=f"[num_blocks, page_size, {nbytes}] (FP8)")
    else:
        check_tensor("kv_cache", kv_cache, dtypes=(torch.bfloat16, torch.float16, torch.float32),
                     shape=(None, None, 1, d), shape_text=f"[num_blocks, page_size, 1, d_qk={d}]")
    check_tensor("block_table", block_table, dtypes=_I32, shape=(B, None), shape_text=f"[B={B}, max_blocks] int32")
    check_tensor("ctx_lens", ctx_lens, dtypes=_I32, shape=(B, None), shape_text=f"[B={B}, W <= s_q] int32")
    if ctx_lens.shape[1] > s_q:
        raise ValueError(f"ctx_lens width must be <= s_q={s_q}, got {tuple(ctx_lens.shape)}")
    check_tensor("ctx_width", ctx_width, dtypes=_I32, shape=(1,), shape_text="[1] int32")
    if ctx_lens.untyped_storage().nbytes() < (ctx_lens.storage_offset() + B * s_q) * 4:
        raise ValueError(f"ctx_lens must be a view of a buffer holding >= B*s_q = {B * s_q} int32 values")
    check_tensor("w_q", w_q, dtypes=_F32, shape=(d, None), shape_text=f"[d_qk={d}, index_dim] fp32")
    check_tensor("w_k", w_k, dtypes=_F32, shape=tuple(w_q.shape), shape_text=f"{tuple(w_q.shape)} fp32")
    check_tensor("head_w", head_w, dtypes=_F32, shape=(None,), shape_text="[index_heads] fp32")
    if not 1 <= head_w.shape[0] <= h:
        raise ValueError(f"head_w must have 1..h={h} index heads, got {head_w.shape[0]}")
    check_tensor("out_indices", out_indices, dtypes=_I32, shape=(B, s_q, None), shape_text=f"[B={B}, s_q={s_q}, W] int32")
    if not 1 <= topk <= out_indices.shape[2]:
        raise ValueError(f"topk must be in [1, out_indices width {out_indices.shape[2]}], got {topk}")
    check_device(q.device, kv_cache=kv_cache, block_table=block_table, ctx_lens=ctx_lens, ctx_width=ctx_width, w_q=w_q, w_k=w_k,
                 head_w=head_w, out_indices=out_indices, k_scale=k_scale)


@torch.library.custom_op("mla_fuzz::indexer_topk", mutates_args=("out_indices",))
def indexer_topk(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, ctx_lens: torch.Tensor,
                 ctx_width: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, head_w: torch.Tensor, out_indices: torch.Tensor, topk: int,
                 rank: int, rope_dim: int, fp8_group: int, k_scale: Optional[torch.Tensor] = None) -> None:
    """Write each query token's top-``topk`` cache slots into ``out_indices [B, s_q, W]``
    (int32; ``-1`` past the picks and in columns ``>= topk``).

    q ``[B, s_q, h, d_qk]``; block_table int32 ``[B, max_blocks]``; ctx_lens int32 ``[B, W']``
    (keys visible to token i, 0 = padding), a view at the start of a buffer of ``>= B*s_q``
    values laid out with row stride ``W = ctx_width[0]`` (int32 ``[1]``, on the device, as
    for the decode kernel; tokens ``>= W`` are padding); weights as
    ``mla_ref.IndexerWeights`` (fp32). All contiguous. An fp8_e4m3 cache (float8_e4m3fn
    ``[nb, page, 1, d_qk]``) takes ``k_scale`` (fp32 ``[1]``, read on the device): keys are
    ``e4m3 * k_scale`` in fp64, as the reference's.
    """
    _check(q, kv_cache, block_table, ctx_lens, ctx_width, w_q, w_k, head_w, out_indices, topk, rank, rope_dim,
           fp8_group, k_scale)
    B, s_q = q.shape[:2]
    if B == 0 or s_q == 0:
        return
    page = kv_cache.shape[1]
    P = block_table.shape[1] * page
    pos = torch.arange(P, device=q.device)
    slots = block_table.to(torch.int64)[:, pos // page] * page + pos % page                  # [B, P]
    flat = kv_cache.reshape(kv_cache.shape[0] * page, kv_cache.shape[-1])
    rows = flat[slots.reshape(-1)]
    if kv_cache.dtype == torch.uint8:
        from mla_fuzz.mla_ref import ModelSpec
        spec = ModelSpec(kv_lora_rank=rank, qk_rope_head_dim=rope_dim, fp8_group=fp8_group)
        keys = dequantize_kv_fp8(rows, spec=spec, dtype=torch.float64)
    elif kv_cache.dtype == torch.float8_e4m3fn:
        # a device-side product (no host read of the scale): capturable like the rest
        keys = rows.to(torch.float64) * k_scale.to(torch.float64)
    else:
        keys = rows.to(torch.float64)
    k_idx = (keys @ w_k.to(torch.float64)).reshape(B, P, -1)                                   # [B, P, dim]
    G = head_w.shape[0]
    q_idx = q[:, :, :G].to(torch.float64) @ w_q.to(torch.float64)                             # [B, s_q, G, dim]
    score = torch.einsum("bsgd,bpd->bsgp", q_idx, k_idx)
    score = (score * head_w.to(torch.float64)[None, None, :, None]).sum(2)                     # [B, s_q, P]
    ctx = token_context(ctx_lens, ctx_width, s_q).to(torch.int64)
    visible = pos[None, None, :] < ctx[:, :, None]
    score = torch.where(visible, score, torch.full_like(score, float("-inf")))
    k = min(topk, P)
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :, :k]
    picked = torch.gather(visible, 2, order)
    sel = torch.gather(slots[:, None, :].expand(B, s_q, P), 2, order)
    result = torch.full(out_indices.shape, -1, dtype=torch.int32, device=q.device)
    result[:, :, :k] = torch.where(picked, sel, torch.full_like(sel, -1)).to(torch.int32)
    out_indices.copy_(result)


@indexer_topk.register_fake
def _indexer_topk_fake(q, kv_cache, block_table, ctx_lens, ctx_width, w_q, w_k, head_w, out_indices, topk, rank,
                       rope_dim, fp8_group, k_scale=None) -> None:
    _check(q, kv_cache, block_table, ctx_lens, ctx_width, w_q, w_k, head_w, out_indices, topk, rank, rope_dim, fp8_group,
           k_scale)
