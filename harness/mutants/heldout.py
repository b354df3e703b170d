"""Held-out mutants: a third set of 2026 CUDA-graph decode bugs, kept out of ``ALL``.

Written after the other 23 mutants and the search and diagnosis tuned on them, to measure
the fuzzer on bugs it was never tuned on: ``mla-fuzz mutants --set heldout`` runs them, and
``benchmarks/heldout.py`` measures them the way ``cpu-2026-11-28-fresh-mutants.json`` measured
the previous fresh set (first on the search as it stood, untouched). Each one is a small
subclass of our backend or of an example backend with one bug put back, each by a mechanism
none of the mutants in ``ALL`` uses. Do not add them to ``ALL`` / ``EXPECTED``: the mutation
matrix (and so the tuning) must not see them.

The last four (``example-pool-keyed-kv-view``, ``mtp-repeat-interleave``,
``indexer-batch-q-scale``, ``pad-slots-capture-build``) were written later, the same way and
still unseen by the search: one each on a multi-layer step, an MTP capture, the sparse path's
device indexer and the layer path's cache write, by mechanisms none of the mutants before them
uses. The four after them (``example-real-rows-mask``, ``plan-aliases-slot-mapping``,
``sparse-ping-pong-topk``, ``mtp-uniform-fast-path``) were written the same way at the end of
that day, after the book's padded eager step, and measured untouched on the search as it then
stood (``benchmarks/results/cpu-2026-11-29-fresh-set3-before.json``): the set for judging the
next change to the search. Four more (``example-packed-seq-lens``, ``example-unmasked-values``,
``mtp-lookahead-slots``, ``example-capture-key-bound``) were added after those, written the same
way: one each on a record-layout view, values gathered past a row's run, the MTP slot mapping
and a capture-only host bound, in the classes the held-out set had least of (contiguity,
padding-leak, cache-corruption, capture-divergence); measured untouched on the search as it then
stood (``benchmarks/results/cpu-2026-11-29-fresh5-before.json``: 8/8 found in 1-3 examples,
named right). Two more (``example-append-only-block-table``, ``mtp-slots-sized-by-requests``)
were written the same way: a block table updated by appending (stale pages of a row's earlier
occupant at a stable address) and a per-token buffer sized by requests (an MTP build raises, the
first ``backend-error`` of the set); measured untouched on the search as it then stood
(``benchmarks/results/cpu-2026-11-29-fresh6-before.json``: 4/4 found in 1-2 examples, named
right). ``example-unguarded-stage2`` (stage 2 merging splits stage 1 left unwritten), one of the
first set, moved to ``ALL`` on 2026-11-29 with the diagnosis change written for it (experiments
3 and S): once worked on, a mutant no longer measures the unseen.

``HELDOUT`` maps name -> backend class; ``HELDOUT_EXPECTED`` maps name -> diagnosis classes
that are a correct explanation of that bug.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch

from mla_fuzz.examples.sglang_style import SGLangStyleBackend, sglang_decode
from mla_fuzz.examples.triton_decode import TritonDecodeBackend
from mla_fuzz.kernels import TritonMLABackend, plan_reference
from mla_fuzz.kernels.indexer import indexer_topk


class StaleSlotTail(TritonMLABackend):
    """The persistent ``slot_mapping`` refreshed for the real requests only: the builder copies
    rows ``[:B]`` into the ``[pad, next_n]`` buffer and leaves rows ``B..pad-1`` as they were,
    relying on the -1 they held at allocation. After a step with more real requests, the padded
    rows of a later step still hold that step's slots, so the cache write (``write_kv``, the
    layer path) stores the padded rows' latent (stale or NaN inputs) into live cache slots.
    Shaped after vLLM V1's model runner, which must fill the persistent slot mapping past the
    step's tokens with -1 ("needed for reshape_and_cache in full CUDA graph mode"): this
    builder drops that fill."""

    name = "stale-slot-tail"

    def _fill_metadata(self, batch):
        if not self.graph_safe:
            return super()._fill_metadata(batch)
        B, pad = batch.batch_size, batch.padded_size
        left = self._flat_view("slot_mapping", (pad, batch.next_n)).clone()  # what earlier steps left
        md = super()._fill_metadata(batch)
        md.slot_mapping[B:].copy_(left[B:])  # only the real requests' rows were copied
        return md


class SparseFrozenWidth(TritonMLABackend):
    """Sparse MTP decode that decides which query tokens are real from the *shape* of the build's
    per-token context lengths: ``md.ctx_lens`` is a ``[pad, max_decode_len]`` view, so the forward
    pads ``ctx_lens > 0`` out to ``next_n`` columns by the view's width. The width is a Python int
    of the build; a graph captured at one ``max_decode_len`` keeps the capture's view shape, while
    every later build lays the flat buffer out with its own width. Replays at another width (MTP
    batches with ``max_decode_len < next_n`` on either side) read other tokens' lengths: real
    tokens get no top-k rows (output 0) and padding tokens get some. The backend's own path reads
    the width from the device (``ctx_width``) for exactly this reason."""

    name = "sparse-frozen-width"

    def _sparse_rows(self, md):
        pad, n, width = md.padded_size, md.next_n, md.ctx_lens.shape[1]
        real = torch.zeros(pad, n, dtype=torch.bool, device=md.ctx_lens.device)
        real[:, :width] = md.ctx_lens > 0
        md.topk_rows.view(pad, n).copy_(torch.where(real, md.topk_length[:, None], 0))


class PartialsSizedAtBuild(TritonMLABackend):
    """The split-KV workspace (the fp32 partials of split requests) sized for the batch at hand:
    the builder plans on the host to count the pieces this batch's split requests need and the
    forward allocates exactly that many partial rows, instead of the config's upper bound. Under
    a CUDA graph the allocation is made once, at capture, for the capture batch; a replay whose
    rows are longer (more pieces) has the decode write partials past the captured buffer and
    the combine read them back. Shaped after vLLM's FlashAttention builder, which sets
    ``max_num_splits`` to an upper bound under full CUDA graphs "so that large enough intermediate
    buffers are pre-allocated during capture". Only shows when requests are split: long rows."""

    name = "partials-sized-at-build"

    def _fill_metadata(self, batch):
        md = super()._fill_metadata(batch)
        cfg = md.config
        seq = md.seq_lens.cpu().tolist()  # build time: host reads are allowed here
        _, nsplit, _ = plan_reference(seq, num_parts=cfg.num_parts, block_n=cfg.block_n,
                                      min_tiles_per_part=cfg.min_tiles_per_part)
        md.partial_rows = max(1, sum(n for n in nsplit if n > 1))
        return md

    def forward(self, q, kv_cache, metadata, out=None):
        md = metadata
        if md.sparse:
            return super().forward(q, kv_cache, md, out)
        self._check_forward(q, kv_cache, md, out)
        self._plan(md)
        out, lse = self._alloc_outputs(q, md, out)
        rows, rank = md.next_n * self.spec.num_heads, self.spec.kv_lora_rank
        partial_o = torch.empty(md.partial_rows, rows, rank, dtype=torch.float32, device=q.device)
        partial_lse = torch.empty(md.partial_rows, rows, dtype=torch.float32, device=q.device)
        self._decode(q, kv_cache, md, out, lse, partial_o, partial_lse)
        self._combine(md, out, lse, partial_o, partial_lse)
        return out, lse


class LazyWriteScale(TritonMLABackend):
    """The fp8_e4m3 cache write quantising with a copy of the layer's scale taken at its first
    use: ``write_kv`` snapshots ``k_scale`` the first time it runs (the scale is "a per-layer
    constant") and quantises every later step's keys with that copy, while the decode reads the
    current scale. Once the engine changes the scale, the keys a step writes are stored at the
    old scale and read back at the new one. Shaped after the per-layer ``_k_scale_float`` copies
    vLLM backends feed to their cache writes. The layer path only (``write_kv``)."""

    name = "lazy-write-scale"

    def write_kv(self, kv_cache, latent, rope, metadata):
        md = metadata
        if md.k_scale is not None:
            if getattr(self, "_write_scale", None) is None:  # first use: take the layer's scale
                self._write_scale = md.k_scale.clone()
            md = dataclasses.replace(md, k_scale=self._write_scale)
        super().write_kv(kv_cache, latent, rope, md)


class EvictedSizeBuffer(TritonMLABackend):
    """Persistent ``seq_lens`` buffers per padded batch size, from a least-recently-used cache
    bounded to as many sizes as there are capture sizes (so eager batches of other sizes do not
    grow memory): a build of a new size evicts the oldest size's buffer, and the next build of
    the evicted size allocates a new one. A graph captured at that size keeps reading the
    evicted buffer, so after eager steps of other sizes its replays decode with lengths from
    before the eviction. Addresses are stable until the cache evicts: a build alone never looks
    wrong."""

    name = "evicted-size-buffer"

    def _stage(self, name, host):
        if name != "seq_lens" or not self.graph_safe:
            return super()._stage(name, host)
        cache = self.__dict__.setdefault("_seq_lens_by_size", OrderedDict())
        pad = host.shape[0]
        buf = cache.pop(pad, None)
        if buf is None:
            buf = torch.zeros(pad, dtype=torch.int32, device=self.device)
        cache[pad] = buf  # most recently used last
        while len(cache) > max(1, len(self.capture_sizes)):
            cache.popitem(last=False)
        buf.copy_(host)
        return buf


class ExamplePoolKeyedKVView(TritonDecodeBackend):
    """The kernels' view of the KV cache memoised per cache *allocation*: the forward brings the
    cache an engine hands it into the kernels' ``[num_blocks, page, 1, d_qk]`` layout (vLLM's MLA
    caches come as ``[num_blocks, page, d_qk]`` and get an ``unsqueeze(2)``; V is then the first
    ``kv_lora_rank`` columns of that K view) once, and keeps it in a dict keyed by the allocation's
    address, dtype and shape (``untyped_storage().data_ptr()``: the same for every view of one
    allocation, so an engine that re-slices its cache each step still hits the memo). Right as
    long as each layer's cache is an allocation of its own; when the layers' caches are views of
    one pool allocation (TensorRT-LLM's KV pool with per-layer offsets, layers sharing one tensor
    in vLLM's hybrid KV-cache groups, the harness's ``kv_pool``), every layer has the same key: the
    first layer to run binds its cache and every later layer of every step attends the first
    layer's keys and values, in eager steps and in the captured graph alike. One layer per step,
    or any layer run alone, is right."""

    name = "example-pool-keyed-kv-view"

    def _kernel_cache(self, kv_cache):
        memo = self.__dict__.setdefault("_kv_views", {})
        key = (kv_cache.untyped_storage().data_ptr(), kv_cache.dtype, tuple(kv_cache.shape))
        view = memo.get(key)
        if view is None:  # first use of this allocation: make the kernels' view once
            view = memo[key] = kv_cache if kv_cache.dim() == 4 else kv_cache.unsqueeze(2)
        return view

    def forward(self, q, kv_cache, metadata):
        return super().forward(q, self._kernel_cache(kv_cache), metadata)


class MTPRepeatInterleave(TritonMLABackend):
    """Ragged MTP's per-token context lengths derived in the forward, vLLM-style, from the step's
    ``query_start_loc`` (int32 ``[pad + 1]``, staged by the builder into a persistent buffer, padded
    rows with no tokens) and ``seq_lens``: ``torch.repeat_interleave(q_lens)`` maps every query token
    to its request, then each token's visible keys are ``seq_len - q_len + i + 1``. Eagerly this is
    exactly what the builder's ``ctx_lens`` holds. But ``repeat_interleave`` is given no
    ``output_size``: its length ``sum(q_lens)`` is a device value, so ATen reads
    ``cumsum(repeats)[-1]`` on the host (a device->host copy and a stream sync), which CUDA forbids
    while a graph is being captured (and, were it allowed, would freeze the capture batch's token
    count into the graph). Engines pass the host-known token count as ``output_size``; this
    forward drops it. Only MTP batches
    (``next_n > 1``) take the ragged path: the capture of an MTP graph fails."""

    name = "mtp-repeat-interleave"

    def _fill_metadata(self, batch):
        md = super()._fill_metadata(batch)
        B, pad = batch.batch_size, batch.padded_size
        host = torch.zeros(pad + 1, dtype=torch.int32)
        host[1:B + 1] = torch.cumsum(batch.q_lens.to(torch.int32), 0)
        host[B + 1:] = host[B]  # padded rows: no query tokens
        if self.graph_safe:
            buf = self.__dict__.get("_query_start_loc")
            if buf is None:
                buf = self._query_start_loc = torch.zeros(self.max_batch + 1, dtype=torch.int32, device=self.device)
            md.query_start_loc = buf[:pad + 1]
            md.query_start_loc.copy_(host)
        else:
            md.query_start_loc = host.to(self.device)
        return md

    def _decode(self, q, kv_cache, md, out, lse, partial_o, partial_lse):
        if md.next_n > 1:
            pad, n, dev = md.padded_size, md.next_n, q.device
            qsl = md.query_start_loc.to(torch.int64)
            q_lens = qsl[1:] - qsl[:-1]
            req = torch.repeat_interleave(q_lens)  # token -> request; no output_size: sum(q_lens) read on the host
            tok = torch.arange(req.numel(), device=dev) - qsl[req]
            ctx = torch.zeros(pad, n, dtype=torch.int32, device=dev)
            ctx[req, tok] = (md.seq_lens.to(torch.int64)[req] - q_lens[req] + tok + 1).to(torch.int32)
            md = dataclasses.replace(md, ctx_lens=ctx, ctx_width=torch.full((1,), n, dtype=torch.int32, device=dev))
        super()._decode(q, kv_cache, md, out, lse, partial_o, partial_lse)


class IndexerBatchQScale(TritonMLABackend):
    """The device top-k indexer's query scale taken per tensor over the whole padded batch. In
    DeepSeek-V3.2's lightning indexer the queries are quantised to FP8 with power-of-two (UE8M0)
    scales and the scale is folded into the per-head weights (``weights * q_scale``), per token
    group in vLLM's and DeepSeek's code. This backend takes one scale for the batch: the amax of
    every row of ``q``, padded rows included (the FP8 cast itself is left out here, the indexer
    scores in fp64, so the power-of-two scale is exact and the selection equals the clean one for
    any finite padding). Padded rows hold whatever the graph's input buffer held; once that is NaN
    (or inf), the amax, the scale and the folded head weights are NaN for every row, every real
    token's scores are NaN and its top-k is the first ``topk`` visible positions instead of the
    best ones. vLLM #37442's batch-wide amax over padded rows, in the sparse indexer: only shows
    with padded rows (graph padding) holding non-finite values; sparse steps with the device
    indexer only."""

    name = "indexer-batch-q-scale"

    def _run_indexer(self, q, kv_cache, md):
        w, spec = self.indexer, self.spec
        heads = w.head_w.shape[0]
        amax = q[:, :, :heads].abs().amax().float()  # one amax over the padded batch
        scale = torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-30))))  # UE8M0: a power of two
        indexer_topk((q / scale).to(q.dtype), kv_cache, md.block_table, md.indexer_ctx, md.ctx_width, w.w_q, w.w_k,
                     w.head_w * scale, md.topk_indices.view(md.padded_size, md.next_n, self.topk_max), md.topk,
                     spec.kv_lora_rank, spec.qk_rope_head_dim, spec.fp8_group, k_scale=md.k_scale)


class PadSlotsCaptureBuild(TritonMLABackend):
    """A capture-time metadata path (vLLM's ``build_for_cudagraph_capture``) that keeps the
    capture's dummy batch out of the KV cache: the forward captured for a graph runs on a
    warmup/dummy batch whose cache write must not land in real blocks, so the capture path hands
    the write a fresh slot mapping of -1 (``PAD_SLOT_ID`` everywhere, ``torch.full_like``) instead
    of filling the persistent one in place. ``build`` (eager steps, and the builds before each
    replay) is untouched and right, and refreshes the persistent slot mapping as always; but the
    captured write reads the capture path's dummy tensor forever: no replay writes the step's keys
    into the cache, and the decode of every replayed step attends whatever the new tokens' slots
    held before (here the cache's earlier contents, in an engine a previous occupant's key). Only
    graph replays on the layer path (``write_kv``) show it."""

    name = "pad-slots-capture-build"

    def build_for_capture(self, batch):
        md = self.build(batch)
        md.slot_mapping = torch.full_like(md.slot_mapping, -1)  # the dummy batch writes nothing
        return md


class ExampleRealRowsMask(TritonDecodeBackend):
    """The example's forward keeping only the real rows' results by boolean-mask indexing: to
    hand the engine exact zeros (lse -inf) for padded rows whatever the kernels left there, it
    gathers the rows with keys (``live = md.seq_lens > 0``; ``res[live] = out[live]``) into
    fresh zero / -inf outputs, the way engine code selects "the real tokens" of a padded batch
    with a mask. Eagerly the result is exactly the clean one. But indexing with a boolean
    tensor is ``nonzero`` underneath: its output length is a device value, read on the host (a
    device->host copy and a stream sync), which CUDA forbids while a graph is being captured
    (and, were it allowed, would freeze the capture batch's live-row count into the graph).
    Every capture fails; eager steps never show it."""

    name = "example-real-rows-mask"

    def forward(self, q, kv_cache, metadata):
        out, lse = super().forward(q, kv_cache, metadata)
        live = metadata.seq_lens > 0  # [pad] bool: the rows with keys
        res = torch.zeros_like(out)
        res_lse = torch.full_like(lse, float("-inf"))
        res[live] = out[live]  # boolean-mask indexing: nonzero, a host read of the row count
        res_lse[live] = lse[live]
        return res, res_lse


class PlanAliasesSlotMapping(TritonMLABackend):
    """The planner's per-request plan (``num_splits`` / ``split_offsets``, int32 ``[pad]``
    each) carved out of the slot mapping's memory: to keep the step's int metadata in one
    allocation, the builder lets the plan overlap the int64 ``slot_mapping`` buffer, on the
    liveness argument that the cache write consumes the slot mapping before the planner runs
    (``write_kv`` precedes ``forward`` in a layer). True for one layer; in a step of several
    layers on one build, the first layer's planner overwrites the slot mapping and every later
    layer's cache write reads plan words as slots: its keys land in the wrong slots or (out of
    range) nowhere, and it attends whatever those slots held. The eager and the graph paths
    alike; any re-run of a forward on the same build (warmup and capture sharing one build, as
    vLLM's do) reads the clobbered mapping too. Shaped after engines' shared int workspaces
    (FlashInfer's int workspace buffer, vLLM's workspace manager) whose carving assumed a
    lifetime the layer loop breaks. The layer path (``write_kv``) only."""

    name = "plan-aliases-slot-mapping"

    def _fill_metadata(self, batch):
        md = super()._fill_metadata(batch)
        if not self.graph_safe or md.sparse:
            return md
        pad = md.padded_size
        words = self._buffers["slot_mapping"].view(torch.int32)  # the slot mapping's bytes, as int32
        md.num_splits, md.split_offsets = words[:pad], words[pad:2 * pad]  # "dead once the write ran"
        return md


class SparsePingPongTopk(TritonMLABackend):
    """The sparse path's persistent top-k index buffer double-buffered: with asynchronous
    scheduling (the next step's metadata prepared while the current step still runs, vLLM's
    async scheduling, SGLang's overlap scheduler) a builder cannot rewrite the buffer the
    running kernel reads, so it alternates between two persistent ``topk_indices`` buffers,
    build by build. Each buffer is allocated once and always rewritten whole (entries then -1),
    so an eager step is always right. A graph captured on one buffer keeps reading it: every
    other build writes the other one, and its replay attends the selection of the step before
    (whatever step last wrote the captured buffer). Sparse steps with an engine-given (ragged)
    selection only."""

    name = "sparse-ping-pong-topk"

    def _stage_topk(self, batch, pad):
        if not self.graph_safe:
            return super()._stage_topk(batch, pad)
        host, lens = self.host_topk(batch, pad, self.topk_max)
        pair = self.__dict__.get("_topk_pair")
        if pair is None:
            first = self._buffers["topk_indices"]
            pair = self._topk_pair = (first, torch.full_like(first, -1))
        self._topk_parity = 1 - getattr(self, "_topk_parity", 1)  # the buffer the last step did not use
        buf = pair[self._topk_parity][:host.numel()].view(host.shape)
        buf.copy_(host)
        return buf, self._stage("topk_length", lens)


class MTPUniformFastPath(TritonMLABackend):
    """MTP decode dispatched on the host between a uniform fast path and the ragged path: the
    builder notes whether every request has ``next_n`` query tokens (``uniform``, a Python bool
    of the build), and the forward, for a uniform batch, derives each token's visible keys on
    the device from ``seq_lens`` alone (``seq_len - next_n + i + 1``) instead of reading the
    per-token context lengths. Both are right for the batch they were chosen for. Under a CUDA
    graph the branch is taken once, at capture: a graph captured on a uniform batch replays the
    fast path for every later batch of that size, ragged ones (``q_lens < next_n``, short
    ``max_decode_len``) included, whose tokens then see the wrong number of keys and whose
    padding tokens attend. Shaped after vLLM's uniform-decode CUDA-graph dispatch for
    speculative decoding, where only uniform batches may replay the graph captured for them.
    MTP (``next_n > 1``) with ragged query lengths, after a uniform capture."""

    name = "mtp-uniform-fast-path"

    def _fill_metadata(self, batch):
        md = super()._fill_metadata(batch)
        n, B = batch.next_n, batch.batch_size
        md.uniform = n > 1 and int(batch.max_decode_len) == n and bool((batch.q_lens[:B] == n).all())
        return md

    def _decode(self, q, kv_cache, md, out, lse, partial_o, partial_lse):
        if getattr(md, "uniform", False):  # a host branch: the capture's choice is the graph's
            n, dev = md.next_n, q.device
            i = torch.arange(n, device=dev, dtype=torch.int64)[None, :]
            seq = md.seq_lens.to(torch.int64)[:, None]
            ctx = torch.where(seq > 0, (seq - n + i + 1).clamp(min=0), torch.zeros_like(seq)).to(torch.int32)
            md = dataclasses.replace(md, ctx_lens=ctx, ctx_width=torch.full((1,), n, dtype=torch.int32, device=dev))
        super()._decode(q, kv_cache, md, out, lse, partial_o, partial_lse)


class ExamplePackedSeqLens(TritonDecodeBackend):
    """The example's per-request ints uploaded as one record per request: to make the step's
    upload one host-to-device copy (as FlashInfer's ``plan()`` fills a page-locked int buffer
    and copies it at once), the builder keeps a persistent ``[max_batch, 2]`` int32 buffer of
    ``(seq_len, num_pages)`` records, writes the step's rows in one ``copy_`` and hands the
    kernel the ``seq_len`` column, ``packed[:pad, 0]``: a view with stride 2. The stage-1 kernel
    indexes ``seq_lens`` flat (``SeqLens + req``, as vLLM's ``_fwd_kernel_stage1`` loads
    ``B_Seqlen + cur_batch``), so request b reads record ``b // 2``'s field ``b % 2``: request 1
    decodes with request 0's page count as its length, and so on. Stable address, right
    values, wrong layout (vLLM #42135's class, by a record layout instead of a 2-D slice).
    A batch padded to one row is a contiguous view and right; two rows or more, eager or
    graph, are wrong."""

    name = "example-packed-seq-lens"

    def _stage(self, name, host):
        if name != "seq_lens":
            return super()._stage(name, host)
        packed = self.__dict__.get("_packed")
        if packed is None:  # allocated once: graph-safe
            packed = self._packed = torch.zeros(self.max_batch, 2, dtype=torch.int32, device=self.device)
        pad = host.shape[0]
        pages = (host + self.page_size - 1) // self.page_size
        packed[:pad].copy_(torch.stack([host, pages], 1))  # one upload for the step's records
        return packed[:pad, 0]  # the seq_len column: stride 2


class ExampleUnmaskedValues(SGLangStyleBackend):
    """The SGLang-shaped decode masking the scores of the positions past a row's run but not
    the values it gathers there: every row reads ``max_tokens`` positions of ``kv_indices``
    from its ``kv_indptr`` start, the scores past the run are ``-inf`` (softmax weight 0) and the
    values are taken as gathered, on the reasoning that a weight of 0 makes them irrelevant.
    But ``0 * NaN`` is NaN: past a row's run lie the next rows' slots, the padded rows' slot in
    the null block and the persistent ``cuda_graph_kv_indices``' tail (zeros: the null block's
    slot 0, or slots of pages an earlier step used), whose contents belong to no live request
    and may be NaN or inf (never-written or freed pages). vLLM #936 zeroed V past the context
    in the paged-attention kernel for exactly this, FlashInfer fills out-of-bounds V tiles with
    zeros (``kFillZero``) and vLLM #47305 bounded the Triton kernels' K/V loads by ``seq_len``:
    the clean decode masks the values (``torch.where(valid, ...)``). Eager builds hand the
    batch's own indices and clamp into them, so only the graph paths (replays, padded eager
    steps) with non-finite padding show it: every real row whose ``max_tokens`` window reaches
    such a slot."""

    name = "example-unmasked-values"

    def forward(self, q, kv_cache, metadata, out=None):
        md, spec = metadata, self.spec
        bs, d_qk = q.shape[0], kv_cache.shape[-1]
        slots_kv = kv_cache.reshape(-1, d_qk)
        start = md.kv_indptr[:bs].long()
        pos = torch.arange(self.max_tokens, device=q.device)
        valid = pos[None, :] < (md.kv_indptr[1:bs + 1].long() - start)[:, None]
        idx = (start[:, None] + pos[None, :]).clamp(0, max(md.kv_indices.numel() - 1, 0))
        keys = slots_kv[md.kv_indices[idx].long().clamp(0, slots_kv.shape[0] - 1)].float()  # unmasked
        scores = torch.einsum("bhd,btd->bht", q[:, 0].float(), keys) * spec.softmax_scale
        probs = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)  # weight 0 past the run
        res = torch.einsum("bht,btv->bhv", probs, keys[..., :spec.kv_lora_rank]).unsqueeze(1).to(q.dtype)
        if out is not None:
            out.copy_(res)
            res = out
        return res, None


class MTPLookaheadSlots(TritonMLABackend):
    """The MTP slot mapping derived by the builder from the block table for the uniform
    ``[pad, next_n]`` token layout, vLLM-style (``BlockTable.compute_slot_mapping`` from each
    token's position): token column i of a real request sits at ``seq_len - q_len + i``, the
    padding tokens of a ragged request included (they continue the row, as their RoPE positions
    do), and only padded rows get -1. vLLM allocates lookahead slots for speculative tokens
    (``num_lookahead_tokens``), so there a padding token's key lands in a spare slot of the
    request's own; an engine that allocates pages for the step's real tokens only (SGLang's
    per-token ``out_cache_loc``, this harness) has no such slots: the write stores padding
    tokens' latent past the sequence's end in its last page or, past that page, in whatever
    page the block table's unused columns name (another request's keys). Layer steps
    (``write_kv``) with ragged MTP only: ``next_n > 1`` and a real request with ``q_len <
    next_n``; eager steps and replays alike."""

    name = "mtp-lookahead-slots"

    def _fill_metadata(self, batch):
        md = super()._fill_metadata(batch)
        B, ps = batch.batch_size, batch.page_size
        if B and batch.next_n > 1:
            pos = (batch.seq_lens - batch.q_lens).to(torch.int64)[:, None] + torch.arange(batch.next_n)
            cols = (pos // ps).clamp(max=batch.block_table.shape[1] - 1)
            slots = batch.block_table.to(torch.int64).gather(1, cols) * ps + pos % ps
            md.slot_mapping[:B].copy_(torch.where((batch.seq_lens > 0)[:, None], slots, -1))  # padded rows only
        return md


class ExampleCaptureKeyBound(SGLangStyleBackend):
    """The SGLang-shaped decode's key bound (the positions each row reads, SGLang's
    ``max_context_len``) set per path: ``build`` (eager and replay) leaves it at the config's
    bound, as always, but the capture path, written from the eager path's habit of sizing
    the kernel for the batch at hand, bounds it by the capture batch's longest row (rounded up
    to a page), and the forward hands the kernel the metadata's bound. A Python int: the
    graph keeps the capture's, and a replayed row longer than the capture batch's longest
    attends only its first keys. The shape of the capture/replay divergence SGLang's backends
    had (a split count computed on the replay path and not at capture) before the paths were
    unified. Replays with a row longer than the capture batch's longest, rounded up to a
    page."""

    name = "example-capture-key-bound"

    def build_for_capture(self, batch):
        md = super().build_for_capture(batch)
        longest = int(batch.seq_lens.max()) if batch.batch_size else 1
        md.max_tokens = -(-longest // batch.page_size) * batch.page_size  # the capture batch's bound
        return md

    def forward(self, q, kv_cache, metadata, out=None):
        bound = getattr(metadata, "max_tokens", self.max_tokens)
        res = sglang_decode(q, kv_cache, metadata.kv_indptr, metadata.kv_indices, self.spec.softmax_scale,
                            self.spec.kv_lora_rank, bound)
        if out is not None:
            out.copy_(res)
            res = out
        return res, None


class ExampleAppendOnlyBlockTable(TritonDecodeBackend):
    """The example's persistent block table updated by appending, vLLM-style: the builder
    keeps each row's page count from the last step on the host (``num_blocks_per_row``) and
    writes only the columns of the pages a row gained since (``append_row``: decode adds at
    most a page per step, so the upload is one column instead of a whole row), on the
    persistent-batch reasoning that a request keeps its row until it finishes. A row whose
    page count shrank is taken for a new request and rewritten whole (``add_row``); padded rows
    are rewritten (null block) and counted empty. But a new request landing in a row (a
    finished request's row reused, rows condensed or reordered between steps) with as many or
    more pages than the row had is "grown": its first columns keep the previous occupant's
    pages, at the same address, and the kernel attends them. vLLM's ``BlockTable`` resets the
    row's count in ``add_row`` when a request arrives; this builder has no request identity and
    drops that reset. Eager steps and replays alike: any step after one whose row held other
    pages than the same row's request now has, with no fewer pages."""

    name = "example-append-only-block-table"

    def build(self, batch):
        before = self._block_table.clone()  # what earlier steps left in the persistent table
        md = super().build(batch)
        B, pad, cols = batch.batch_size, batch.padded_size, self.max_blocks_per_seq
        known = self.__dict__.setdefault("_pages_in_row", [0] * self.max_batch)
        pages = [-(-int(s) // batch.page_size) for s in batch.seq_lens.tolist()]
        kept = torch.zeros(pad, cols, dtype=torch.bool)
        for b in range(pad):
            if b < B and pages[b] >= known[b]:  # "the same request, grown": append its new pages only
                kept[b] = True
                kept[b, known[b]:pages[b]] = False
            known[b] = pages[b] if b < B else 0  # shrunk rows and padded rows were rewritten whole
        old = before[:pad * cols].view(pad, cols)
        md.block_table.copy_(torch.where(kept.to(md.block_table.device), old, md.block_table))
        return md


class MTPSlotsSizedByRequests(TritonMLABackend):
    """The persistent ``slot_mapping`` (int64, one entry per query *token*) allocated like the
    per-request buffers beside it, at ``max_batch`` entries (SGLang's CUDA-graph runner sized
    its token buffers ``max_bs`` before speculative decoding, now ``max_bs *
    num_tokens_per_bs``; vLLM sizes its slot mapping by ``max_num_batched_tokens``, not
    ``max_num_seqs``). Right for one token per request; an MTP build (``next_n > 1``) needs
    ``pad * next_n`` entries, so once the padded batch is more than ``max_batch / next_n``
    requests the build cannot stage the step's slots and raises (on a GPU, a raw kernel
    writing the mapping would run past the buffer instead). Graph-safe backends only (eager
    builds stage fresh tensors); MTP steps padded past ``max_batch / next_n``, capture,
    warmup, replay or eager."""

    name = "mtp-slots-sized-by-requests"

    def _alloc_buffers(self):
        super()._alloc_buffers()
        # "one new token per request per decode step": sized like seq_lens
        self._buffers["slot_mapping"] = torch.full((self.max_batch,), -1, dtype=torch.int64, device=self.device)


HELDOUT = {
    "stale-slot-tail": StaleSlotTail,
    "sparse-frozen-width": SparseFrozenWidth,
    "partials-sized-at-build": PartialsSizedAtBuild,
    "lazy-write-scale": LazyWriteScale,
    "evicted-size-buffer": EvictedSizeBuffer,
    "example-pool-keyed-kv-view": ExamplePoolKeyedKVView,
    "mtp-repeat-interleave": MTPRepeatInterleave,
    "indexer-batch-q-scale": IndexerBatchQScale,
    "pad-slots-capture-build": PadSlotsCaptureBuild,
    "example-real-rows-mask": ExampleRealRowsMask,
    "plan-aliases-slot-mapping": PlanAliasesSlotMapping,
    "sparse-ping-pong-topk": SparsePingPongTopk,
    "mtp-uniform-fast-path": MTPUniformFastPath,
    "example-packed-seq-lens": ExamplePackedSeqLens,
    "example-unmasked-values": ExampleUnmaskedValues,
    "mtp-lookahead-slots": MTPLookaheadSlots,
    "example-capture-key-bound": ExampleCaptureKeyBound,
    "example-append-only-block-table": ExampleAppendOnlyBlockTable,
    "mtp-slots-sized-by-requests": MTPSlotsSizedByRequests,
}

HELDOUT_EXPECTED = {
    # padded rows write into live slots: the integrity oracle's class
    "stale-slot-tail": {"cache-corruption"},
    # a Python int of the capture's build (the view's width) frozen into the graph
    "sparse-frozen-width": {"laziness"},
    # a host-side size decided from the capture batch, frozen into the graph (its symptom is an
    # access outside the captured buffer, but out-of-bounds would blame the kernel's indexing)
    "partials-sized-at-build": {"laziness"},
    # lazily initialised state read stale by every later step: laziness, or stale contents
    "lazy-write-scale": {"laziness", "stale-address"},
    # a tensor the captured graph reads, re-created by a later build
    "evicted-size-buffer": {"stale-address"},
    # a memo keyed by what all layers of one pool share: the layers of a step share state
    "example-pool-keyed-kv-view": {"layer-state"},
    # a data-dependent output size (an implicit device->host read) inside the capture
    "mtp-repeat-interleave": {"host-sync"},
    # a batch-wide reduction over padded rows carries their NaN into every real row
    "indexer-batch-q-scale": {"padding-leak"},
    # the capture-time metadata path hands the graph a tensor the replay path never refreshes
    "pad-slots-capture-build": {"capture-divergence"},
    # boolean-mask indexing (nonzero: a data-dependent size read on the host) inside the capture
    "example-real-rows-mask": {"host-sync"},
    # a forward overwrites metadata (the slot mapping) that the next layer's cache write reads
    "plan-aliases-slot-mapping": {"layer-state", "cache-corruption"},
    # a metadata tensor the captured graph reads, swapped for another buffer by later builds
    "sparse-ping-pong-topk": {"stale-address"},
    # a host-side dispatch decision of the capture's build frozen into the graph
    "mtp-uniform-fast-path": {"laziness"},
    # a column of a record (array-of-structs) buffer, stride 2, handed to a kernel that indexes it flat
    "example-packed-seq-lens": {"contiguity"},
    # NaN/inf in padding slots (null block, unused pages) reaches real rows as 0 * NaN
    "example-unmasked-values": {"padding-leak"},
    # the cache write stores padding tokens' keys into slots no real token writes
    "mtp-lookahead-slots": {"cache-corruption"},
    # the capture path alone sizes a host int from the capture batch; the graph freezes it
    "example-capture-key-bound": {"capture-divergence", "laziness"},
    # a persistent table updated by appending: a row's earlier columns keep another request's pages
    "example-append-only-block-table": {"stale-address"},
    # a persistent per-token buffer sized by requests: an MTP build past max_batch / next_n raises
    "mtp-slots-sized-by-requests": {"backend-error"},
}

__all__ = ["HELDOUT", "HELDOUT_EXPECTED"] + [c.__name__ for c in HELDOUT.values()]
