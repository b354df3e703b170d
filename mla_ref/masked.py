"""The reference decode without host reads: fixed shapes and masks, so it can be captured.

``mla_decode`` validates its arguments and walks requests on the host (``.tolist()``), which
a CUDA graph capture forbids. ``mla_decode_masked`` computes the same function with tensor
ops only: every request gathers all ``max_blocks`` pages of its block-table row (entries
past its length are read but masked), scores are masked to each token's visible keys
(bottom-right causal MTP), and tokens with no visible key get out 0 and lse -inf. It is
what a backend author wraps to get a slow but graph-safe, correct backend
(``examples/reference_backend.py``). Dense decode only; no argument checks (``mla_decode``
has them).

    out[b, i, h] = sum_j softmax_j(scale * q[b, i, h] . k[b, j]) * v[b, j],
    j over keys 0 .. seq_len[b] - q_len[b] + i        (i < q_len[b])
"""
from __future__ import annotations

from typing import Optional

import torch

from .cache import is_fp8_cache, is_fp8_e4m3_cache
from .fp8 import dequantize_kv_fp8
from .fp8_tensor import KScale, _dequantize, _scale_on
from .spec import ModelSpec


def mla_decode_masked(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      cache_seqlens: torch.Tensor, *, spec: ModelSpec, q_lens: Optional[torch.Tensor] = None,
                      softmax_scale: Optional[float] = None,
                      k_scale: Optional[KScale] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla_decode`` (dense, causal) with no host read.

    Args:
        q: ``[B, s_q, h_q, d_qk]`` bf16/fp16/fp32.
        kv_cache: floating ``[num_blocks, page_size, 1, d_qk]`` (float8_e4m3fn included) or uint8
            FP8 ``[num_blocks, page_size, fp8_bytes]``.
        block_table: int32 ``[B, max_blocks]``; every entry must be a valid page id (padding
            rows point at the null block), since all of them are gathered.
        cache_seqlens: int32 ``[B]``; q_lens: int32 ``[B]`` (``None`` = all ``s_q``).
        k_scale: the fp8_e4m3 cache's scale, required for it: a 1-element fp32 tensor (read on
            the device, so a captured graph follows in-place updates; its value is not
            checked, that would be a host read) or a float.
    Returns:
        ``out [B, s_q, h_q, kv_lora_rank]`` in q's dtype, ``lse [B, h_q, s_q]`` fp32 (fp64 for
        fp64 q; natural log); out 0 and lse -inf for a token with no visible key. Computed in
        fp32 (fp64 for fp64 q), like ``mla_decode``.
    """
    B, s_q, h_q, _ = q.shape
    nb = block_table.shape[1]
    ps = kv_cache.shape[1]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    if k_scale is not None and not is_fp8_e4m3_cache(kv_cache):
        raise ValueError(f"k_scale is only for an fp8_e4m3 (float8_e4m3fn) cache; kv_cache is {kv_cache.dtype}")
    pages = kv_cache[block_table.long()]  # [B, nb, ps, ...]
    if is_fp8_cache(kv_cache):
        keys = dequantize_kv_fp8(pages.reshape(B, nb * ps, -1), spec=spec, dtype=compute)
    elif is_fp8_e4m3_cache(kv_cache):
        if k_scale is None:
            raise ValueError("k_scale is required for an fp8_e4m3 kv_cache (float8_e4m3fn): its values are "
                             "e4m3 * k_scale")
        keys = _dequantize(pages.reshape(B, nb * ps, spec.d_qk), _scale_on(k_scale, kv_cache.device), compute)
    else:
        keys = pages.reshape(B, nb * ps, spec.d_qk).to(compute)
    scale = spec.softmax_scale if softmax_scale is None else float(softmax_scale)
    sl = cache_seqlens.to(torch.int64)
    ql = sl.new_full((B,), s_q) if q_lens is None else q_lens.to(torch.int64)
    tok = torch.arange(s_q, device=q.device)
    last = (sl - ql).unsqueeze(1) + tok.unsqueeze(0)                       # [B, s_q] last visible key
    real = tok.unsqueeze(0) < ql.unsqueeze(1)                              # [B, s_q]
    pos = torch.arange(nb * ps, device=q.device)
    # keys past a request's length (other pages, poisoned padding) are zeroed, not only
    # masked: 0 * NaN would still reach the output through the PV product
    keys = torch.where((pos.view(1, -1) < sl.unsqueeze(1)).unsqueeze(-1), keys, torch.zeros((), device=q.device))
    visible = (pos.view(1, 1, -1) <= last.unsqueeze(-1)) & real.unsqueeze(-1)  # [B, s_q, N]
    scores = torch.einsum("bshd,bnd->bhsn", q.to(compute), keys) * scale
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                  # [B, h, s_q]
    p = torch.where(visible.unsqueeze(1), torch.exp(scores - lse.unsqueeze(-1)), torch.zeros_like(scores))
    out = torch.einsum("bhsn,bnv->bshv", p, keys[..., : spec.kv_lora_rank])
    return out.to(q.dtype), lse
