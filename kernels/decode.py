"""``kernels.mla_decode``: the Triton implementation of ``mla_ref.mla_decode``'s contract."""
from __future__ import annotations

from typing import Optional

import torch

from mla_ref import ModelSpec

from . import ops
from .checks import check_tensor
from .config import DecodeConfig, check_spec_supported, default_config
from .sched import SchedState

__all__ = ["mla_decode", "context_lens", "alloc_partials"]


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


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
               *, spec: ModelSpec, softmax_scale: Optional[float] = None, causal: bool = True,
               q_lens: Optional[torch.Tensor] = None, sched: Optional[SchedState] = None,
               config: Optional[DecodeConfig] = None,
               out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode attention on the paged latent cache (same contract as ``mla_ref.mla_decode``).

    Args:
        q: ``[B, s_q, h_q, d_qk]`` bf16/fp16/fp32, contiguous, ``h_q == spec.num_heads``.
        kv_cache: floating ``[num_blocks, page_size, 1, d_qk]`` or uint8 FP8
            ``[num_blocks, page_size, spec.fp8_bytes_per_token]``, contiguous.
        block_table: int32 ``[B, max_blocks]``; cache_seqlens: int32 ``[B]``.
        softmax_scale: default ``spec.softmax_scale``.
        causal: bottom-right MTP mask (token ``i < q_len`` sees keys ``[0, seq_len - q_len + i]``).
        q_lens: int32 ``[B]`` real tokens per request (None = all s_q).
        sched: a ``SchedState``; None plans afresh for this call. A given state is planned on
            first use and *reused as is afterwards* (FlashMLA's lazy contract) — pass a new
            one whenever ``cache_seqlens`` changes.
        config: launch configuration (default ``default_config(spec, s_q, q.device, fp8=...)``,
            or the state's if it has one).
        out: optional ``[B, s_q, h_q, kv_lora_rank]`` q-dtype buffer to write into.
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
    if config is None:
        config = sched.config if sched is not None and sched.config is not None else \
            default_config(spec, s_q, q.device, fp8=kv_cache.dtype == torch.uint8)
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
                     config.num_stages, config.fp8_prefetch)
    ops.combine(partial_o, partial_lse, sched.num_splits, sched.split_offsets, out, lse, config.combine_block_m)
    return out, lse
