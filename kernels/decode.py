"""``kernels.mla_decode``: the Triton implementation of ``mla_ref.mla_decode``'s contract."""
from __future__ import annotations

from typing import Optional

import torch

from mla_fuzz.mla_ref import ModelSpec

from . import ops
from .checks import check_tensor
from .config import DecodeConfig, check_spec_supported
from .routes import default_config
from .sched import SchedState

__all__ = ["mla_decode", "context_lens", "token_context", "alloc_partials", "alloc_sparse_partials", "dense_rows",
           "decode_sparse_rows"]


def context_lens(cache_seqlens: torch.Tensor, q_lens: Optional[torch.Tensor], s_q: int, *,
                 causal: bool = True) -> torch.Tensor:
    """Keys visible to each query token, computed on the device (no host sync).

    Args:
        cache_seqlens: int32 ``[B]``; q_lens: int32 ``[B]`` or None (= s_q everywhere).
    Returns:
        int32 ``[B, s_q]`` contiguous: token ``i < q_lens[b]`` sees ``seq_len - q_len + i + 1``
        keys (bottom-right causal) or ``seq_len`` (non-causal); padding tokens 0.
    """
    i = torch.arange(s_q, device=cache_seqlens.device, dtype=torch.int32)
    seq = cache_seqlens.to(torch.int32)[:, None]
    ql = seq * 0 + s_q if q_lens is None else q_lens.to(torch.int32)[:, None]
    vis = seq - ql + i + 1 if causal else seq.expand(-1, s_q)
    return torch.where(i < ql, vis.clamp(min=0), torch.zeros_like(vis)).to(torch.int32).contiguous()


def alloc_partials(config: DecodeConfig, s_q: int, num_heads: int, rank: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scratch for split requests: ``([cap, s_q*h, rank], [cap, s_q*h])``, cap from the config."""
    cap = config.partial_capacity()
    rows = s_q * num_heads
    return (torch.empty(cap, rows, rank, dtype=torch.float32, device=device),
            torch.empty(cap, rows, dtype=torch.float32, device=device))


def token_context(ctx_lens: torch.Tensor, ctx_width: torch.Tensor, s_q: int) -> torch.Tensor:
    """Keys visible to each query token, read the way the kernels read it: int32 ``[B, s_q]``.

    ``ctx_lens`` is a ``[B, W']`` view at the start of a flat buffer holding ``B * s_q`` or
    more elements; its layout has row stride ``W = ctx_width[0]`` (a *device* value, so a
    captured graph follows the current step's width even though the view's shape was fixed
    at capture). Tokens ``i >= W`` are padding (0). Device ops only: no host sync.
    """
    B = ctx_lens.shape[0]
    dev = ctx_lens.device
    flat = ctx_lens.as_strided((B * s_q,), (1,))
    w = ctx_width.to(torch.int64)
    i = torch.arange(s_q, device=dev, dtype=torch.int64)[None, :]
    lin = torch.arange(B, device=dev, dtype=torch.int64)[:, None] * w + i
    valid = i < w
    lin = torch.where(valid, lin, torch.zeros_like(lin)).clamp(max=max(B * s_q - 1, 0))
    vals = flat[lin.reshape(-1)].reshape(B, s_q) if B * s_q else torch.zeros(B, s_q, dtype=torch.int32, device=dev)
    return torch.where(valid, vals, torch.zeros_like(vals)).to(torch.int32)


def alloc_sparse_partials(config: DecodeConfig, num_heads: int, rank: int,
                          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scratch for split rows of the sparse decode: ``([cap, h, rank], [cap, h])``."""
    cap = config.partial_capacity()
    return (torch.empty(cap, num_heads, rank, dtype=torch.float32, device=device),
            torch.empty(cap, num_heads, dtype=torch.float32, device=device))


def dense_rows(indices: torch.Tensor, q_lens: Optional[torch.Tensor],
               topk_length: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Row extents of a dense ``[B, s_q, topk]`` selection, on the device (no host sync).

    Returns:
        ``(row_start, row_len)`` int32 ``[B*s_q]`` each: row ``b*s_q + i`` starts at
        ``(b*s_q + i) * topk`` and counts ``topk_length[b]`` entries (``topk`` when None,
        clamped to ``[0, topk]``) for real tokens ``i < q_lens[b]``, 0 for padding tokens.
    """
    B, s_q, topk = indices.shape
    dev = indices.device
    i = torch.arange(s_q, device=dev, dtype=torch.int32)
    n = torch.full((B, 1), topk, device=dev, dtype=torch.int32) if topk_length is None else \
        topk_length.to(torch.int32).clamp(0, topk)[:, None]
    real = i[None, :] < (torch.full((B, 1), s_q, device=dev, dtype=torch.int32) if q_lens is None
                         else q_lens.to(torch.int32)[:, None])
    row_len = torch.where(real, n, torch.zeros_like(n)).to(torch.int32).reshape(-1).contiguous()
    row_start = (torch.arange(B * s_q, device=dev, dtype=torch.int32) * topk).contiguous()
    return row_start, row_len


def decode_sparse_rows(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, row_start: torch.Tensor,
                       row_len: torch.Tensor, sched: SchedState, out: torch.Tensor, lse: torch.Tensor, *,
                       spec: ModelSpec, softmax_scale: float, plan: bool = True,
                       k_scale: Optional[torch.Tensor] = None) -> None:
    """Planner (over ``row_len``) -> sparse decode -> combine, writing ``out`` / ``lse``.

    Args:
        q: ``[B, s_q, h, d_qk]``; indices int32 flat ``[N]``; row_start / row_len int32 ``[B*s_q]``.
        sched: plan buffers for ``B*s_q`` rows (``sched.config`` is the launch config).
        out: ``[B, s_q, h, rank]`` q dtype; lse: fp32 ``[B, h, s_q]`` (both written in place).
        plan: launch the planner (``force``) first; False uses the plan already in ``sched``.
        k_scale: fp32 ``[1]`` on the device, the scale of an fp8_e4m3 cache (only then).
    """
    cfg = sched.config
    B, s_q, h, _ = q.shape
    if plan:
        sched.plan(row_len, force=True)
    partial_o, partial_lse = alloc_sparse_partials(cfg, h, spec.kv_lora_rank, q.device)
    # rows x heads: the layout the combine kernel writes for s_q == 1; permuted into lse below
    lse_rows = torch.empty(B * s_q, h, dtype=torch.float32, device=q.device)
    ops.decode_sparse(q, kv_cache, indices, row_start, row_len, sched.part_info, sched.num_splits,
                      sched.split_offsets, out, lse_rows, partial_o, partial_lse, softmax_scale, spec.kv_lora_rank,
                      spec.qk_rope_head_dim, spec.fp8_group, cfg.block_m, cfg.block_n, cfg.num_warps,
                      cfg.num_stages, k_scale=k_scale)
    ops.combine(partial_o, partial_lse, sched.num_splits, sched.split_offsets,
                out.view(B * s_q, 1, h, spec.kv_lora_rank), lse_rows.view(B * s_q, h, 1), cfg.combine_block_m,
                cfg.combine_col_blocks)
    lse.copy_(lse_rows.view(B, s_q, h).permute(0, 2, 1))


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
               *, spec: ModelSpec, softmax_scale: Optional[float] = None, causal: bool = True,
               q_lens: Optional[torch.Tensor] = None, sched: Optional[SchedState] = None,
               config: Optional[DecodeConfig] = None,
               out: Optional[torch.Tensor] = None, indices: Optional[torch.Tensor] = None,
               topk_length: Optional[torch.Tensor] = None,
               k_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode attention on the paged latent cache (same contract as ``mla_ref.mla_decode``).

    Args:
        q: ``[B, s_q, h_q, d_qk]`` bf16/fp16/fp32, contiguous, ``h_q == spec.num_heads``.
        kv_cache: floating ``[num_blocks, page_size, 1, d_qk]`` (bf16/fp16/fp32, or float8_e4m3fn
            with ``k_scale``) or uint8 FP8 ``[num_blocks, page_size, spec.fp8_bytes_per_token]``,
            contiguous.
        block_table: int32 ``[B, max_blocks]``; cache_seqlens: int32 ``[B]``.
        softmax_scale: default ``spec.softmax_scale``.
        causal: bottom-right MTP mask (token ``i < q_len`` sees keys ``[0, seq_len - q_len + i]``).
        q_lens: int32 ``[B]`` real tokens per request (None = all s_q).
        sched: a ``SchedState``; None plans afresh for this call. A given state is planned on
            first use and *reused as is afterwards* (FlashMLA's lazy contract) — pass a new
            one whenever ``cache_seqlens`` changes.
        config: launch configuration (default ``default_config(spec, s_q, q.device, fp8=..., batch=B)``,
            or the state's if it has one).
        out: optional ``[B, s_q, h_q, kv_lora_rank]`` q-dtype buffer to write into.
        indices: int32 ``[B, s_q, topk]`` contiguous (sparse decode): global cache slots
            ``block * page_size + offset`` each query token attends to, ``-1`` = invalid;
            ``causal``, ``block_table`` and ``cache_seqlens`` are then not used for attention.
            Work is split per (request, token) row; ``sched`` then holds a plan of ``B*s_q`` rows.
        topk_length: int32 ``[B]``: only the first ``topk_length[b]`` entries of request b's rows count.
        k_scale: an fp8_e4m3 cache's scale, fp32 ``[1]`` on q's device (required for that cache
            only). The kernels load it when they run, so changing it in place changes the next
            launch's keys (a captured graph's too).
    Returns:
        ``out [B, s_q, h_q, kv_lora_rank]`` (q dtype) and ``lse [B, h_q, s_q]`` fp32 (natural
        log); tokens with no visible key get exactly 0 and -inf.

    Device values (lengths, page ids) are not validated: that would need a host sync.
    """
    check_spec_supported(spec)
    check_tensor("q", q, dtypes=(torch.bfloat16, torch.float16, torch.float32), shape=(None, None, None, spec.d_qk),
                 shape_text=f"[B, s_q, h_q, d_qk={spec.d_qk}]")
    B, s_q, h, _ = q.shape
    if h != spec.num_heads:
        raise ValueError(f"q heads (dim 2) must be spec.num_heads = {spec.num_heads}, got {h}")
    if q_lens is not None:
        check_tensor("q_lens", q_lens, dtypes=(torch.int32,), shape=(B,), shape_text=f"[B={B}] int32")
    check_tensor("cache_seqlens", cache_seqlens, dtypes=(torch.int32,), shape=(B,), shape_text=f"[B={B}] int32")
    if indices is None and topk_length is not None:
        raise ValueError("topk_length is only meaningful with indices (sparse decode), but indices is None")
    if indices is not None:
        check_tensor("indices", indices, dtypes=(torch.int32,), shape=(B, s_q, None),
                     shape_text=f"[B={B}, s_q={s_q}, topk] int32")
        if topk_length is not None:
            check_tensor("topk_length", topk_length, dtypes=(torch.int32,), shape=(B,), shape_text=f"[B={B}] int32")
        # one row = one (request, token): the row block covers the heads of one token
        config = config or (sched.config if sched is not None and sched.config is not None else
                            default_config(spec, 1, q.device, fp8=kv_cache.dtype == torch.uint8, sparse=True,
                                           fp8_e4m3=kv_cache.dtype == torch.float8_e4m3fn))
        if sched is None:
            sched = SchedState(config)
        row_start, row_len = dense_rows(indices, q_lens, topk_length)
        if sched.config is None:
            sched.config = config
        if out is None:
            out = torch.empty(B, s_q, h, spec.kv_lora_rank, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, h, s_q, dtype=torch.float32, device=q.device)
        sched.plan(row_len, config=config)
        decode_sparse_rows(q, kv_cache, indices.view(-1), row_start, row_len, sched, out, lse, spec=spec,
                           softmax_scale=spec.softmax_scale if softmax_scale is None else float(softmax_scale),
                           plan=False, k_scale=k_scale)
        return out, lse
    if config is None:
        config = sched.config if sched is not None and sched.config is not None else \
            default_config(spec, s_q, q.device, fp8=kv_cache.dtype == torch.uint8, batch=B,
                           fp8_e4m3=kv_cache.dtype == torch.float8_e4m3fn)
    scale = spec.softmax_scale if softmax_scale is None else float(softmax_scale)
    if sched is None:
        sched = SchedState(config)
    sched.plan(cache_seqlens, config=config)

    ctx = context_lens(cache_seqlens, q_lens, s_q, causal=causal)
    ctx_width = torch.full((1,), s_q, dtype=torch.int32, device=q.device)
    if out is None:
        out = torch.empty(B, s_q, h, spec.kv_lora_rank, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, h, s_q, dtype=torch.float32, device=q.device)
    partial_o, partial_lse = alloc_partials(config, s_q, h, spec.kv_lora_rank, q.device)
    ops.decode_split(q, kv_cache, block_table, cache_seqlens, ctx, ctx_width, sched.part_info, sched.num_splits,
                     sched.split_offsets, out, lse, partial_o, partial_lse, scale, spec.kv_lora_rank,
                     spec.qk_rope_head_dim, spec.fp8_group, config.block_m, config.block_n, config.num_warps,
                     config.num_stages, config.fp8_grouped, config.kernel, k_scale=k_scale)
    ops.combine(partial_o, partial_lse, sched.num_splits, sched.split_offsets, out, lse, config.combine_block_m,
                config.combine_col_blocks)
    return out, lse
