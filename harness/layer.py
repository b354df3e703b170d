"""``MLADecodeLayer``: one MLA layer's decode step on a decode backend (absorbed form).

Reference math plus backend calls, so the harness runs a layer over any backend without
importing our kernels (``mla_fuzz.kernels`` never imports it back).

The projections are ``mla_ref``'s (compress_kv, project_q, absorb_q, unabsorb_out,
o_project — the per-tensor FP8 amax included); the cache write and the attention go
through the backend (``write_kv`` + ``forward``). So on the real rows it computes what
``mla_ref.mla_layer_decode_absorbed`` computes, and on a padded batch the batch-wide FP8
amax sees the padded rows: exactly the path by which unwritten padding output leaked into
real rows upstream (vLLM #37442).
"""
from __future__ import annotations

from typing import Any

import torch

from mla_fuzz.mla_ref import (MLALayerWeights, ModelSpec, absorb_q, compress_kv, o_project, project_q,
                     unabsorb_out)

__all__ = ["MLADecodeLayer", "decode_positions"]


def decode_positions(seq_lens: torch.Tensor, q_lens: torch.Tensor, next_n: int, pad: int = None) -> torch.Tensor:
    """RoPE positions of this step's query tokens: int64 ``[pad, next_n]``.

    Token ``i`` of request ``b`` sits at ``seq_lens[b] - q_lens[b] + i`` (the step's tokens
    are the last ``q_lens[b]`` of the sequence); values for padding tokens and padded rows
    follow the same formula, clamped at 0 (their outputs are discarded).
    """
    B = seq_lens.shape[0]
    pad = B if pad is None else int(pad)
    if pad < B:
        raise ValueError(f"pad must be >= batch size {B}, got {pad}")
    pos = torch.zeros(pad, next_n, dtype=torch.int64, device=seq_lens.device)
    i = torch.arange(next_n, dtype=torch.int64, device=seq_lens.device)
    pos[:B] = (seq_lens.to(torch.int64) - q_lens.to(torch.int64))[:, None] + i
    return pos.clamp(min=0)


class MLADecodeLayer:
    """Absorbed MLA layer decode over a backend.

    Args:
        spec: model dims; weights: ``mla_ref.MLALayerWeights``;
        backend: anything with ``write_kv(kv_cache, latent, rope, metadata)`` and
            ``forward(q, kv_cache, metadata)`` (e.g. ``TritonMLABackend``).
    """

    def __init__(self, spec: ModelSpec, weights: MLALayerWeights, backend: Any) -> None:
        if not hasattr(backend, "write_kv") or not hasattr(backend, "forward"):
            raise ValueError("backend must provide write_kv(...) and forward(...)")
        self.spec = spec
        self.weights = weights
        self.backend = backend

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, metadata: Any,
                 fp8_out: bool = False) -> torch.Tensor:
        """One decode step (device work only; capturable).

        Args:
            hidden: ``[pad, s_q, hidden]`` float; positions: int64 ``[pad, s_q]``.
            kv_cache: the paged cache (this step's tokens are written into it first).
            metadata: the backend's ``build`` result for this step.
            fp8_out: per-tensor FP8 quantisation of the attention output before o_proj
                (one amax over the whole padded batch).
        Returns:
            ``[pad, s_q, hidden]`` in hidden's dtype.
        """
        spec, w = self.spec, self.weights
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[2] != spec.hidden:
            raise ValueError(f"hidden must be [pad, s_q, hidden={spec.hidden}], got "
                             f"{tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__}")
        if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 \
                or tuple(positions.shape) != tuple(hidden.shape[:2]):
            raise ValueError(f"positions must be int64 {tuple(hidden.shape[:2])}, got "
                             f"{(positions.dtype, tuple(positions.shape)) if isinstance(positions, torch.Tensor) else type(positions).__name__}")
        latent, k_rope = compress_kv(w, hidden, positions, spec=spec)
        self.backend.write_kv(kv_cache, latent, k_rope, metadata)
        q_nope, q_rope = project_q(w, hidden, positions, spec=spec)
        q = absorb_q(w, q_nope, q_rope, spec=spec)
        out_latent, _ = self.backend.forward(q, kv_cache, metadata)
        return o_project(w, unabsorb_out(w, out_latent, spec=spec), spec=spec, fp8_out=fp8_out)
