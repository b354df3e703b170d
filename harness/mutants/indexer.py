"""Mutant whose bug is the top-k indexer's view of the per-token context lengths."""
from __future__ import annotations

import torch

from mla_fuzz.kernels import TritonMLABackend


class IndexerTwoDContextLens(TritonMLABackend):
    """vLLM #42135 in the sparse indexer: the builder keeps per-token context lengths in a
    2-D ``[max_seqs, next_n]`` buffer and hands the indexer its ``[:B, :max_decode_len]``
    slice — non-contiguous whenever ``max_decode_len < next_n`` (and B > 1), so a kernel
    indexing it flat reads other requests' lengths (``.contiguous()`` was rejected
    upstream: it allocates, breaking graph address stability)."""

    name = "indexer-2d-context-lens"

    def _indexer_context_lens(self, ctx, pad, width):
        buf = self.__dict__.get("_idx_ctx2d")
        if buf is None:
            buf = torch.zeros(self.max_batch, self.next_n_max, dtype=torch.int32, device=self.device)
            self._idx_ctx2d = buf
        view = buf[:pad, :width]
        view.copy_(ctx)
        return view
