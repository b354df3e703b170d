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


class PadWithLastRequest(TritonMLABackend):
    """Padded rows filled with a copy of the last real request instead of empty rows (the
    "dummy request" padding engines use for kernels that want every row to hold at least
    one key): rows ``B..pad-1`` get request ``B-1``'s seq_len, block-table row and per-token
    context lengths (their slot mapping stays -1, so nothing is written to the cache). The
    padded rows now really attend, with query rows that belong to padding (stale, or NaN
    in the fuzzer's poisoned steps), so their outputs are garbage instead of exactly 0, and
    the layer's batch-wide FP8 amax before o_proj carries them into every real row (the
    path of vLLM #37442)."""

    name = "pad-with-last-request"

    def _fill_metadata(self, batch):
        md = super()._fill_metadata(batch)
        B, pad = batch.batch_size, batch.padded_size
        if 0 < B < pad:
            md.seq_lens[B:] = md.seq_lens[B - 1]
            md.block_table[B:] = md.block_table[B - 1]
            md.ctx_lens[B:] = md.ctx_lens[B - 1]
        return md
