"""Mutants whose bug is padding and zero-length rows leaking into real rows."""
from __future__ import annotations

import torch

from mla_fuzz.kernels import TritonMLABackend


class UninitPaddingAmax(TritonMLABackend):
    """vLLM #37442 (reverted by #38359): rows with no keys — every padded row — are never
    written, so they hold whatever the graph pool held (NaN, stale activations); the
    per-tensor FP8 amax before o_proj reduces over the whole padded batch and carries it
    into every real row."""

    name = "uninit-padding-amax"

    def _combine(self, md, out, lse, partial_o, partial_lse):
        blank_out, blank_lse = out.clone(), lse.clone()  # what the allocator left there
        super()._combine(md, out, lse, partial_o, partial_lse)
        has_keys = md.seq_lens > 0
        out.copy_(torch.where(has_keys.view(-1, 1, 1, 1), out, blank_out))
        lse.copy_(torch.where(has_keys.view(-1, 1, 1), lse, blank_lse))


class NanZeroLen(TritonMLABackend):
    """#38148's shape: the softmax normaliser of a row with no keys is 0 and the merge
    divides by it unguarded (0/0), so zero-length rows — real empty requests and every
    padded row — come out NaN instead of 0."""

    name = "nan-zero-len"

    def _combine(self, md, out, lse, partial_o, partial_lse):
        super()._combine(md, out, lse, partial_o, partial_lse)
        denom = (md.seq_lens > 0).to(out.dtype).view(-1, 1, 1, 1)
        out.mul_(denom).div_(denom)
