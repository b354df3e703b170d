"""Mutants whose bug is state shared across the attention layers of one step (issue #44 item 6).

An engine builds the metadata once per step and every attention layer's forward reads it,
each with its own KV cache and queries; a captured graph holds all of those calls. Each
mutant below is right for a step of one layer (a forward run twice on the same inputs gives
the same bits, a replay equals an eager forward), so a search that runs one layer per step
never sees it; with two or more layers on one build, a later layer reads what an earlier one
left behind.
"""
from __future__ import annotations

import dataclasses

import torch

from mla_fuzz.kernels import TritonMLABackend


class PoolRebasedBlockTable(TritonMLABackend):
    """Metadata mutated by a forward: the KV caches of a model's layers are views of one pool
    allocation (layer ``l`` at pages ``[l * n, (l + 1) * n)``, as TensorRT-LLM's pool with
    per-layer block offsets), and the kernels address the whole pool by pool-global page ids.
    The forward rebases the step's block table onto its layer's pages **in place, in the
    metadata** (no per-layer copy), guarded so that running a forward twice does not add the
    offset twice: it rebases the page ids that still look layer-local (below ``n``). The
    first layer's offset is 0, so with one layer nothing ever changes; a second layer
    rebases the table past ``n``, after which the guard leaves it alone: a third layer (and
    any re-run of the first) reads the second layer's pages."""

    name = "pool-rebased-block-table"

    def forward(self, q, kv_cache, metadata, out=None):
        md = metadata
        if md.sparse:  # the sparse decode reads slots of the cache it is handed
            return super().forward(q, kv_cache, md, out)
        pages = kv_cache.shape[0]
        first = kv_cache.storage_offset() // kv_cache.stride(0)  # the layer's first page in the pool
        total = kv_cache.untyped_storage().nbytes() // (kv_cache.stride(0) * kv_cache.element_size())
        pool = kv_cache.as_strided((total,) + tuple(kv_cache.shape[1:]), kv_cache.stride(), 0)
        bt = md.block_table
        bt.copy_(torch.where(bt < pages, bt + first, bt))  # in place: the next layer reads this
        return super().forward(q, pool, md, out)


class SharedOutputBuffer(TritonMLABackend):
    """An output buffer shared across layers (and between graph and eager calls): to keep the
    forward allocation-free and the graph's outputs at fixed addresses, the graph-safe
    backend allocates ``out`` and ``lse`` once (at ``max_batch``, per dtype) and returns views
    of them from every forward. Each call overwrites the last one's outputs: harmless when the
    caller consumes an output before the next call (a layer's o_proj does), wrong for a
    caller that holds several — every layer's attention output of a step, a graph's static
    outputs read after an eager call — which all see the last forward's values."""

    name = "shared-output-buffer"

    def _alloc_outputs(self, q, md, out):
        if not self.graph_safe or out is not None:
            return super()._alloc_outputs(q, md, out)
        h, r, n = self.spec.num_heads, self.spec.kv_lora_rank, self.max_batch * self.next_n_max
        bufs = self.__dict__.setdefault("_out_bufs", {})
        if q.dtype not in bufs:
            bufs[q.dtype] = (torch.zeros(n * h * r, dtype=q.dtype, device=q.device),
                             torch.zeros(n * h, dtype=torch.float32, device=q.device))
        o, lse = bufs[q.dtype]
        pad, s_q = md.padded_size, md.next_n
        return o[:pad * s_q * h * r].view(pad, s_q, h, r), lse[:pad * h * s_q].view(pad, h, s_q)


class IndexerOncePerStep(TritonMLABackend):
    """State planned by the first layer and reused by the rest: "plan once per step", done on
    the device so it stays graph-safe. The build clears a persistent flag; the first forward
    after it runs the top-k indexer (DeepSeek-V3.2's lightning indexer) and sets the flag;
    later forwards on the same build see it and keep the selection already in the metadata,
    as a plan that depends only on the lengths may be kept. But the selection depends on the
    layer's own queries and KV cache: every layer after the first attends the keys the first
    layer's indexer picked (a re-run of one layer's forward picks what it picked before, so a
    single layer never shows it)."""

    name = "indexer-once-per-step"

    def _fill_metadata(self, batch):
        md = super()._fill_metadata(batch)
        if md.topk_on_device:
            flag = self.__dict__.get("_selected") if self.graph_safe else None
            if flag is None:
                flag = torch.zeros(1, dtype=torch.int32, device=self.device)
                if self.graph_safe:
                    self._selected = flag
            flag.zero_()  # a new step: nothing selected yet
            md.selected = flag
        return md

    def _run_indexer(self, q, kv_cache, md):
        mine = torch.empty_like(md.topk_indices)
        super()._run_indexer(q, kv_cache, dataclasses.replace(md, topk_indices=mine))
        md.topk_indices.copy_(torch.where(md.selected > 0, md.topk_indices, mine))
        md.selected.fill_(1)
