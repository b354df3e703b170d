"""Mutants whose bug is the ragged top-k selection of sparse decode (vLLM #42604, DSV4 sparse).

Upstream, the ragged top-k indices/indptr were first allocated fresh every step (stale
address under FULL CUDA graphs); the first fix read nnz with ``.item()`` (a host sync,
illegal while capturing) and copied only an nnz-sized slice into the persistent buffer,
leaving the previous step's tail for the kernel to read. One mutant per mistake.
"""
from __future__ import annotations

import torch

from mla_fuzz.kernels import TritonMLABackend


class RaggedFreshAlloc(TritonMLABackend):
    """#42604 as first written: the builder hands the kernel freshly allocated index
    tensors every step; a captured graph keeps reading the capture-time ones."""

    name = "ragged-fresh-alloc"

    def _stage_topk(self, batch, pad):
        host, lens = self.host_topk(batch, pad, self.topk_max)
        return host.to(self.device), lens.to(self.device)


class RaggedItemSync(TritonMLABackend):
    """#42604's first fix: nnz read on the host in the forward path (here: to skip the row
    setup when nothing is selected) — ``.item()`` is a device->host sync, which CUDA
    forbids during capture (and which would bake the capture-time decision into the graph)."""

    name = "ragged-item-sync"

    def _sparse_rows(self, md):
        nnz = int((md.topk_indices >= 0).sum().item())
        if nnz == 0:
            md.topk_rows.zero_()
            return
        super()._sparse_rows(md)


class RaggedStaleTail(TritonMLABackend):
    """#42604's first fix, second half: only the nnz entries the engine handed over are
    copied into the persistent index buffer. The kernel reads each real token's first
    ``topk`` entries (FlashMLA's fixed top-k) and relies on -1 past the row's own entries;
    with an nnz-sized copy those positions still hold the previous step's slots, so a token
    with fewer than ``topk`` entries attends to keys an earlier step selected."""

    name = "ragged-stale-tail"

    def _stage_topk(self, batch, pad):
        if not self.graph_safe:
            return super()._stage_topk(batch, pad)
        host, lens = self.host_topk(batch, pad, self.topk_max)
        _, indptr, _ = batch.ragged_topk()
        n = batch.next_n
        row_len = torch.zeros(pad * n, dtype=torch.int64)
        row_len[:batch.batch_size * n] = (indptr[1:] - indptr[:-1]).to(torch.int64)
        real = torch.zeros(pad * n, dtype=torch.bool)
        real[:batch.batch_size * n] = (torch.arange(n)[None, :] < batch.q_lens[:, None]).reshape(-1)
        written = (torch.arange(self.topk_max)[None, :] < row_len[:, None]) & real[:, None]
        rows, cols = written.nonzero(as_tuple=True)
        buf = self._flat_view("topk_indices", (pad * n, self.topk_max))
        buf[rows.to(self.device), cols.to(self.device)] = host[rows, cols].to(self.device)
        return buf, self._stage("topk_length", lens)


class StaleWorkspaceTail(TritonMLABackend):
    """A stale tail in the per-token context-lengths buffer (the flat persistent buffer the
    builder lays MTP tokens out in, ``[pad, max_decode_len]``): the builder scatters only the
    real tokens' entries into it (an nnz = ``sum(q_lens)``-sized write, as a ragged
    ``qo_indptr``-driven builder produces them) and relies on the rest of the region being 0,
    which it only was at allocation. The kernel reads every entry of the region and takes 0
    for "padding token": after a step whose longer ``q_lens`` (or other width) wrote a length
    where this step has a padding token, that padding token attends to keys and its output
    (0 / -inf by contract) is not. Stable address, stale contents (vLLM #42604's nnz-sized
    copy, in another buffer)."""

    name = "stale-ctx-tail"

    def _fill_metadata(self, batch):
        if not self.graph_safe:
            return super()._fill_metadata(batch)
        B, pad, width = batch.batch_size, batch.padded_size, int(batch.max_decode_len)
        left = self._flat_view("ctx_lens", (pad, width)).clone()  # what earlier steps left there
        md = super()._fill_metadata(batch)
        written = torch.zeros(pad, width, dtype=torch.bool)
        written[:B] = torch.arange(width)[None, :] < batch.q_lens.to(torch.int64)[:, None]
        # only the real tokens' entries were written; everything else keeps the earlier contents
        md.ctx_lens.copy_(torch.where(written.to(self.device), md.ctx_lens, left))
        return md
