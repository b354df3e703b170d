"""Mutants whose bug is memory layout: views and slot mappings."""
from __future__ import annotations

import torch

from mla_fuzz.kernels import TritonMLABackend


class NoncontigContextLens(TritonMLABackend):
    """vLLM #42135: per-token context lengths live in a 2-D ``[max_batch, next_n]`` buffer
    sliced ``[:B, :max_decode_len]``; when ``max_decode_len < next_n`` that view is
    non-contiguous, and a kernel indexing it flat reads the wrong lengths."""

    name = "noncontig-context-lens"

    def _context_lens_view(self, pad, width):
        buf = self.__dict__.get("_ctx2d")
        if buf is None:
            buf = torch.zeros(self.max_batch, self.next_n_max, dtype=torch.int32, device=self.device)
            self._ctx2d = buf
        return buf[:pad, :width]


class PaddedSlotWrite(TritonMLABackend):
    """Padded tokens' ``slot_mapping`` of -1 is not honoured: the write clamps it to slot 0,
    so every padded row and padding token overwrites a real cache slot (the null block's
    first token here; any page in engines that reuse block 0)."""

    name = "padded-slot-write"

    def write_kv(self, kv_cache, latent, rope, metadata):
        metadata.slot_mapping.clamp_(min=0)
        super().write_kv(kv_cache, latent, rope, metadata)
