"""The top-k selector ("indexer") of sparse MLA decode, DeepSeek-V3.2 style, in plain PyTorch.

A low-rank index head scores every visible cached key for each query token and keeps the
``topk`` best: index queries are the first ``index_heads`` attention-query heads projected to
``index_dim``; index keys are the cached latent+rope rows projected the same way; a key's
score is the head-weighted sum of their dot products. (No ReLU as in DeepSeek's lightning
indexer: its exact zeros would make the top-k a tie-break lottery, and the device version
must be checkable against this one.) Scores are computed in fp64; ties go to the earlier
position.

Visibility is MTP-aware (bottom-right causal): real token ``i < q_lens[b]`` sees positions
``[0, seq_lens[b] - q_lens[b] + i]``; padding tokens see nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .cache import check_scale_for, gather_kv
from .fp8_tensor import KScale
from .spec import ModelSpec


@dataclass
class IndexerWeights:
    """``w_q``, ``w_k`` fp32 ``[d_qk, index_dim]``; ``head_w`` fp32 ``[index_heads]``."""

    w_q: torch.Tensor
    w_k: torch.Tensor
    head_w: torch.Tensor

    @property
    def index_heads(self) -> int:
        return int(self.head_w.shape[0])

    @classmethod
    def random(cls, spec: ModelSpec, seed: int, *, index_dim: int = 16, index_heads: int = 4,
               device="cpu") -> "IndexerWeights":
        """Seeded weights; ``index_heads`` is capped at ``spec.num_heads``."""
        if index_dim < 1 or index_heads < 1:
            raise ValueError(f"index_dim and index_heads must be >= 1, got {index_dim}, {index_heads}")
        g = torch.Generator().manual_seed(int(seed) & 0x7FFF_FFFF)
        heads = min(index_heads, spec.num_heads)
        scale = spec.d_qk ** -0.5
        return cls(w_q=(torch.randn(spec.d_qk, index_dim, generator=g) * scale).to(device),
                   w_k=(torch.randn(spec.d_qk, index_dim, generator=g) * scale).to(device),
                   head_w=(torch.rand(heads, generator=g) + 0.5).to(device))

    def to(self, device) -> "IndexerWeights":
        return IndexerWeights(self.w_q.to(device), self.w_k.to(device), self.head_w.to(device))


def indexer_topk(weights: IndexerWeights, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, q_lens: torch.Tensor, topk: int, *, spec: ModelSpec,
                 k_scale: Optional[KScale] = None) -> torch.Tensor:
    """Reference top-k selection.

    Args:
        q: ``[B, s_q, h, d_qk]`` attention queries; kv_cache: any cache layout;
        block_table: int32 ``[B, max_blocks]``; seq_lens, q_lens: int32 ``[B]``; topk >= 1.
        k_scale: the fp8_e4m3 cache's scale (required for it, refused otherwise): index keys
            are projected from ``e4m3 * k_scale`` in fp64.
    Returns:
        int32 ``[B, s_q, topk]``: global slots of each token's best ``min(topk, visible)`` keys
        in descending score order (ties: earlier position first), then ``-1``.
    """
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    scale = check_scale_for(kv_cache, k_scale)
    B, s_q = q.shape[:2]
    page = kv_cache.shape[1]
    out = torch.full((B, s_q, topk), -1, dtype=torch.int32)
    G = weights.index_heads
    for b in range(B):
        L, ql = int(seq_lens[b]), int(q_lens[b])
        keys = gather_kv(kv_cache, block_table[b], L, spec=spec, dtype=torch.float64, k_scale=scale).cpu()
        k_idx = keys @ weights.w_k.double().cpu()
        for i in range(ql):
            visible = L - ql + i + 1
            q_idx = q[b, i, :G].double().cpu() @ weights.w_q.double().cpu()          # [G, index_dim]
            score = (weights.head_w.double().cpu()[:, None] * (q_idx @ k_idx[:visible].T)).sum(0)
            order = torch.sort(score, descending=True, stable=True).indices[:topk]
            slots = [int(block_table[b, p // page]) * page + p % page for p in order.tolist()]
            out[b, i, :len(slots)] = torch.tensor(slots, dtype=torch.int32)
    return out
