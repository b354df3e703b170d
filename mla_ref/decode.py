"""The reference MLA decode op (docs/design.md, "The op contract"): latent attention over a paged cache.

Written for obviousness, not speed: one request at a time, pages gathered explicitly, one
softmax per query token. Everything is computed in fp32 (fp64 when ``q`` is fp64).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .cache import check_kv_cache, check_scale_for, gather_kv, read_slots
from .fp8_tensor import KScale
from .spec import ModelSpec

_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclass
class DecodePlan:
    """The validated host-side view of a decode call's metadata (plain Python ints)."""

    seq_lens: list
    q_lens: list
    topk_lengths: Optional[list]
    k_scale: Optional[float] = None  # the fp8_e4m3 cache's scale (fp32 value), else None


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {tuple(t.shape)}"
    return type(t).__name__


def _check_int_tensor(name: str, t, dtype: torch.dtype, shape: tuple, shape_text: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != len(shape):
        raise ValueError(f"{name} must be {str(dtype).replace('torch.', '')} {shape_text}, got {_describe(t)}")
    for got, want in zip(t.shape, shape):
        if want is not None and got != want:
            raise ValueError(f"{name} must have shape {shape_text} = "
                             f"{tuple('*' if w is None else w for w in shape)}, got {tuple(t.shape)}")


def check_decode_args(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      cache_seqlens: torch.Tensor, *, spec: ModelSpec, q_lens: Optional[torch.Tensor] = None,
                      indices: Optional[torch.Tensor] = None,
                      topk_length: Optional[torch.Tensor] = None,
                      k_scale: Optional[KScale] = None) -> DecodePlan:
    """Validate ``mla_decode``'s arguments; ValueError names the argument, expected vs given.

    ``k_scale`` is required for an fp8_e4m3 cache and refused for any other (``check_scale_for``).
    Only the block-table entries of pages a row actually needs (``ceil(seq_len/page_size)``)
    and only the index entries that count (real tokens, first ``topk_length`` entries) are
    checked: the rest may legitimately hold garbage. Returns the host-side metadata.
    """
    if not isinstance(q, torch.Tensor) or q.dtype not in _Q_DTYPES:
        raise ValueError(f"q must be a bf16/fp16/fp32/fp64 tensor, got {_describe(q)}")
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D [B, s_q, h_q, d_qk], got shape {tuple(q.shape)}")
    B, s_q, h_q, d_qk = q.shape
    if d_qk != spec.d_qk:
        raise ValueError(f"q last dim must be d_qk = kv_lora_rank + qk_rope_head_dim = {spec.d_qk}, got {d_qk}")
    if h_q != spec.num_heads:
        raise ValueError(f"q heads (dim 2) must be spec.num_heads = {spec.num_heads}, got {h_q}")
    check_kv_cache(kv_cache, spec=spec)
    scale = check_scale_for(kv_cache, k_scale)
    num_blocks, page_size = kv_cache.shape[0], kv_cache.shape[1]
    n_slots = num_blocks * page_size

    _check_int_tensor("block_table", block_table, torch.int32, (B, None), f"[B={B}, max_blocks]")
    _check_int_tensor("cache_seqlens", cache_seqlens, torch.int32, (B,), f"[B={B}]")
    seq_lens = [int(v) for v in cache_seqlens.tolist()]
    max_blocks = block_table.shape[1]
    for b, L in enumerate(seq_lens):
        if L < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {L} at row {b}")
        n_pages = -(-L // page_size)
        if n_pages > max_blocks:
            raise ValueError(f"cache_seqlens[{b}] = {L} needs {n_pages} pages of {page_size} but block_table "
                             f"has {max_blocks} columns")
        pages = block_table[b, :n_pages]
        bad = (pages < 0) | (pages >= num_blocks)
        if bool(bad.any()):
            col = int(bad.nonzero()[0, 0])
            raise ValueError(f"block_table[{b}, {col}] = {int(pages[col])} is outside the cache: expected a page "
                             f"in [0, num_blocks={num_blocks}) for the {n_pages} pages row {b} needs")

    if q_lens is None:
        lens = [s_q] * B
    else:
        _check_int_tensor("q_lens", q_lens, torch.int32, (B,), f"[B={B}]")
        lens = [int(v) for v in q_lens.tolist()]
        for b, (ql, L) in enumerate(zip(lens, seq_lens)):
            if ql < 0 or ql > s_q:
                raise ValueError(f"q_lens[{b}] must be in [0, s_q={s_q}], got {ql}")
            if ql > L:
                raise ValueError(f"q_lens[{b}] = {ql} must be <= cache_seqlens[{b}] = {L} "
                                 f"(this step's tokens are part of the cache)")

    topk_lengths = None
    if indices is None:
        if topk_length is not None:
            raise ValueError("topk_length is only meaningful with indices (sparse decode), but indices is None")
    else:
        _check_int_tensor("indices", indices, torch.int32, (B, s_q, None), f"[B={B}, s_q={s_q}, topk]")
        topk = indices.shape[2]
        if topk_length is None:
            topk_lengths = [topk] * B
        else:
            _check_int_tensor("topk_length", topk_length, torch.int32, (B,), f"[B={B}]")
            topk_lengths = [int(v) for v in topk_length.tolist()]
            for b, k in enumerate(topk_lengths):
                if k < 0 or k > topk:
                    raise ValueError(f"topk_length[{b}] must be in [0, topk={topk}], got {k}")
        for b in range(B):
            counted = indices[b, :lens[b], :topk_lengths[b]]
            bad = (counted < -1) | (counted >= n_slots)
            if bool(bad.any()):
                i, j = (int(v) for v in bad.nonzero()[0])
                raise ValueError(f"indices[{b}, {i}, {j}] = {int(counted[i, j])} is outside the cache: expected -1 "
                                 f"or a slot in [0, num_blocks*page_size={n_slots})")
    return DecodePlan(seq_lens=seq_lens, q_lens=lens, topk_lengths=topk_lengths, k_scale=scale)


def attend(q_tok: torch.Tensor, keys: torch.Tensor, softmax_scale: float, d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one query token over an explicit key set.

    Args:
        q_tok: ``[h, d_qk]`` (compute dtype).
        keys: ``[n, d_qk]`` (compute dtype); values are ``keys[:, :d_v]``.
    Returns:
        ``(out [h, d_v], lse [h])`` in the compute dtype; ``n == 0`` gives exactly 0 and -inf.
    """
    h = q_tok.shape[0]
    if keys.shape[0] == 0:
        return (q_tok.new_zeros(h, d_v), q_tok.new_full((h,), float("-inf")))
    scores = (q_tok @ keys.T) * softmax_scale
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return probs @ keys[:, :d_v], lse


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
               *, spec: ModelSpec, softmax_scale: Optional[float] = None, causal: bool = True,
               q_lens: Optional[torch.Tensor] = None, indices: Optional[torch.Tensor] = None,
               topk_length: Optional[torch.Tensor] = None,
               k_scale: Optional[KScale] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference MLA decode attention (FlashMLA conventions).

    Args:
        q: ``[B, s_q, h_q, d_qk]`` bf16/fp16/fp32/fp64, ``h_q == spec.num_heads``.
        kv_cache: floating ``[num_blocks, page_size, 1, d_qk]`` (bf16/fp16/fp32/fp64, or
            float8_e4m3fn with ``k_scale``) or uint8 FP8 ``[num_blocks, page_size, fp8_bytes]``.
        block_table: int32 ``[B, max_blocks]``; entries past a row's needed pages are never read.
        cache_seqlens: int32 ``[B]`` keys per request, including this step's tokens.
        softmax_scale: default ``spec.softmax_scale`` (1/sqrt(nope + rope)).
        causal: bottom-right MTP mask: real token ``i`` sees keys ``[0, seq_len - q_len + i]``;
            ``False``: every real token sees all ``seq_len`` keys. Ignored in sparse mode.
        q_lens: int32 ``[B]`` real query tokens per request (``None`` = all ``s_q``); token
            ``i >= q_lens[b]`` is padding.
        indices: int32 ``[B, s_q, topk]`` global slots (sparse mode), ``-1`` = invalid. Each
            valid entry is one key (a repeated slot counts twice, as in a kernel looping over entries).
        topk_length: int32 ``[B]``: only the first ``topk_length[b]`` entries of each row count.
        k_scale: the fp8_e4m3 cache's per-tensor scale (float or 1-element fp32 tensor, any
            device): keys are ``e4m3 * k_scale`` in the compute dtype. Required for that cache,
            refused for any other.
    Returns:
        ``out [B, s_q, h_q, kv_lora_rank]`` in q's dtype and ``lse [B, h_q, s_q]`` fp32 (natural
        log). A token with no visible key gets out exactly 0 and lse -inf: padding tokens,
        seq_len 0 rows, sparse tokens with no counted valid index, and (only possible with
        ``q_lens=None``) causal tokens whose range ``seq_len - s_q + i`` is negative.
    """
    plan = check_decode_args(q, kv_cache, block_table, cache_seqlens, spec=spec, q_lens=q_lens,
                             indices=indices, topk_length=topk_length, k_scale=k_scale)
    scale = spec.softmax_scale if softmax_scale is None else float(softmax_scale)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, s_q, h_q, _ = q.shape
    d_v = spec.kv_lora_rank
    out = torch.zeros(B, s_q, h_q, d_v, dtype=compute, device=q.device)
    lse = torch.full((B, h_q, s_q), float("-inf"), dtype=compute, device=q.device)

    for b in range(B):
        L, ql = plan.seq_lens[b], plan.q_lens[b]
        if indices is None:
            keys_all = gather_kv(kv_cache, block_table[b], L, spec=spec, dtype=compute,
                                 k_scale=plan.k_scale).to(q.device)
        for i in range(ql):
            if indices is not None:
                row = indices[b, i, :plan.topk_lengths[b]]
                keys = read_slots(kv_cache, row[row >= 0], spec=spec, dtype=compute,
                                  k_scale=plan.k_scale).to(q.device)
            elif causal:
                # bottom-right alignment: the last real token sees the whole sequence
                keys = keys_all[:max(L - ql + i + 1, 0)]
            else:
                keys = keys_all
            o, l = attend(q[b, i].to(compute), keys, scale, d_v)
            out[b, i] = o
            lse[b, :, i] = l
    return out.to(q.dtype), lse.to(torch.float32)
