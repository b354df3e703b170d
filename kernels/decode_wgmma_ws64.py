"""Hopper FP8 split-KV decode at 64-row blocks, warp-specialised: a producer partition copies and
dequantises the next key tile while the two consumer warpgroups run this one's dots (Gluon, GPU only).

The same contract, plan, numerics and stores as ``decode_wgmma._decode_wgmma_kernel`` for an
FP8 cache (grid ``(num_parts, m_blocks)``; a request that is not split stores ``out``/``lse``,
a split one its fp32 partial; the keys dequantised ``code * scale`` in fp32, rounded to bf16,
as the Triton kernel's dequantise path), with the work split differently. In that kernel the
eight warps dequantise each tile themselves, between its copies landing and its QK dot: the
tensor cores wait for the conversion every tile, and FP8 at h=128 ran slower than bf16 (H100,
B=128, L=16k, s_q=1: 2155 against 1536 us, ``benchmarks/results/h100-2026-11-26-kernel-15.json``).
Here two partitions (``gl.warp_specialize``) hand dequantised 64-key tiles over through two
shared buffers and two mbarriers a buffer (ready / empty):

- the *producer* (4 warps, 64 registers a thread) walks the part's requests and tiles as the
  consumer does. For each tile it waits for a free buffer and ``cp.async``-copies the tile
  into it in four commit groups (rope, scales and scale group 0's codes; then groups 1, 2, 3),
  dequantising each group's codes *in place* as soon as its commit group has landed: the bf16
  K tile ``[64, 512]`` (64 KiB) holds the tile's 32 KiB of codes in its upper half, staged
  group-major (group ``g`` at ``32 KiB + 8 KiB * g``). The K tile's shared layout (128-byte
  swizzle: 64-column chunks of ``64 x 128`` bytes one after another) puts scale group ``g``'s
  bf16 values at bytes ``[16 KiB * g, 16 KiB * (g + 1))``: groups 0 and 1 are written where no
  codes are, group 2 over groups 0-1's codes once every producer thread has read them, group
  3 over its own and group 2's once every thread holds them (barriers between). A thread
  dequantises 8 codes at a time, so its bf16 values are one 16-byte store and the 16 threads of
  a row write distinct banks (16 codes, two stores, ran 0.96-1.00x: ``h200-2026-11-27-ws64-dequant-vec.json``,
  ``h100-2026-11-27-ws64-dequant-vec-recheck.json``; docs/kernel-performance.md, ``-kernel-36``). Keys past
  ``seq_len`` are masked copies, which land as zeros (a NaN-poisoned stale slot never reaches
  a dot).
- the *consumer* (8 warps, two warpgroups; the launch's ``num_warps``; at up to 32 rows one
  warpgroup, below) is the loop of ``decode_wgmma`` without its copies and conversion: per
  tile it waits for the PV dot of the tile before and hands that tile's buffer back, waits for
  this tile's buffer to be ready, runs ``S = Q K^T`` (each warpgroup 32 keys), the softmax (row
  max and sum across both warpgroups) and issues ``acc += P V`` (each warpgroup 256 of the 512
  columns).

Shared memory at rank 512 + rope 64: q 72 KiB, P 8 KiB, two buffers of a K tile (64 KiB), its
rope (8 KiB) and its scales (1 KiB): 226 KiB of the H100's 227 -- the 16-bit kernel's two tiles
and no room for a separate ring of codes, hence the in-place staging. Registers: the kernel
is capped at 168 a thread (12 warps x 32 x 168 <= 64K); the producer's 4 warps get 64, the
consumer's 8 the rest (216; compiled for sm_90: no spills in its loop). ptxas compiles every
partition under the cap, so 8 producer warps (cap 128) cannot hold the consumer's 64x256
accumulator ("insufficient registers").

Measured on an H100, in the full benchmark grid, old code (c212cbb) and new in one command
(``benchmarks/results/h100-2026-11-26-kernel-16*.json``; B 1-128, L 1k-16k): FP8 h=128 s_q=1
1.06-1.28x (geo-mean 1.18), s_q=2 1.06-1.30x (1.22); at B=128, L=16k s_q=1 2158 -> 1683 us (the
bf16 kernel: 1535), s_q=2 4257 -> 3269; every other case 0.99-1.02x. Ablations
(``h100-2026-11-26-wgmma-ws64-ab.json``; B=128, L=16k, h=128, s_q=1, timing only): the producer
alone (the consumer only handing buffers back) 1106 us, the consumer alone (the producer only
copying) 1228 -- together they slow each other down (shared-memory bandwidth and the issue
slots of the same SM sub-partitions), and with only two buffers each tile's copy latency stays
in the producer's path. Tried and not kept (same json, six cases h=128 and h=16 x 2):
dequantising only once all four commit groups have landed, 0.92-0.96x; issuing a tile's QK
before waiting for the previous PV, 0.85-1.00x; asking L2 for the next tile's rows a tile ahead
(``cp.async.bulk.prefetch.L2``, a row a key), 0.90-1.04x; 56 producer registers (the consumer
224), 0.93-0.98x. h=16 at s_q=2 (32 rows, then padded to 64 here) first kept the keys-on-M
kernel of ``decode_wgmma_keys`` (this one took it later, below): this one ran B=128, L=16k in
881 us and B=8, L=16k in 78 (the ablation command), that kernel 800 and 76 in the full grid
(``-kernel-16.json``; another command on the same kind of GPU, so only indicative). Mutants of
this kernel against its GPU test (same json): five give wrong results the test catches (codes
staged in the lower half, group 1 read before it lands, a group's scale swapped, the copy mask
or the causal mask dropped), three hang it (a ready or empty wait dropped, the last buffer
never handed back), and two races were never observed on an H100 (the barrier before group 3
overwrites staged codes, the fence before the producer's arrival).

The producer loads each tile's page a tile ahead of its copies when a page holds whole tiles
(``gluon_parts.tile_page``: one block-table read off the copies' path instead of one a key on
it): FP8 h=128 1.01-1.11x (geo-mean 1.06 at s_q=1, 1.07 at s_q=2; B=128, L=16k 1710 -> 1552 and
3291 -> 2999 us), old code (77f59e9) and new in one command
(``h100-2026-11-26-kernel-18-before-77f59e9.json`` / ``-kernel-18.json``).

**Up to 32 query rows a request** (h=16 x 2 tokens, h=8 x 4; ``W64_KEYS_ROWS``) the launch
takes a keys-on-M consumer instead (``_w64_keys_consumer``, the same producer and tiles): the
scores ``S^T [64 keys, 32 rows] = K Q^T`` and the accumulator ``acc^T [512, 32] += K^T P^T``
put the keys / latent columns on the wgmma M axis and the rows on N, each warpgroup half the
rows (``[4, 2]`` warps), so that no padding rows are computed, the softmax of a row stays in
one warpgroup (no exchange between them) and q (32 rows) takes half the shared memory (191
KiB in all). The values are the 64-row consumer's (bf16 ``code * scale`` keys, P in bf16),
only the dots' shapes differ. Measured on an H100, FP8 h=16 s_q=2, old (22354fa) and new code
in one command over the full grid (``h100-2026-11-26-kernel-23*.json``): 1.005-1.048x
(geo-mean 1.03; B=32, L=1k 30.6 -> 29.2 us, B=128, L=16k 785 -> 772), every other case
0.985-1.025x; the same consumer against the 64-row one in one process, 1.00-1.05x
(``h100-2026-11-26-ws64-keys.json``). Its K tile is read by both warpgroups (the 64-row
consumer splits the keys between them and reads q twice instead), so by its dots' operand sizes
it reads about as much shared memory a tile (~310 KiB); what it saves is the padding rows' dots.
Since 2026-11-27 that consumer is one warpgroup holding all 32 rows (``W64_KEYS_WARPS`` = 4:
``[4, 1]`` warps, the launch's 4 warps beside the producer's 4, ``W64_KEYS_MAXNREG`` registers:
its accumulator ``acc^T [512, 32]`` is 128 a thread), so each dot reads the K tile once (about
170 KiB a tile instead of 310). Outputs bit for bit the two-warpgroup consumer's; against it, in
one process on an H100 (FP8 h=16 s_q=2, B 8-128, L 1k-16k,
``h100-2026-11-27-ws64-keys-one-warpgroup.json``): 0.997-1.050x, B=8 L=16k 69.2 -> 66.6 us,
B=128 L=16k 773 -> 736. That consumer needs 128 threads x 256 registers, half the register file,
so the producer beside it can have more warps (``W64_KEYS_PRODUCER_WARPS`` / ``_REGS``): 8 warps
of 72 registers ran 1.03-1.06x 4 of 64 (B=128 L=16k 734 -> 691 us), 8 x 80 1.03-1.06x, 8 x 64
1.01-1.05x, 8 x 96 1.01-1.02x, 4 x 128 1.00-1.04x, 16 x 56 0.98-1.00x, all bit for bit the same
(same json).

Where the time goes at h=16 s_q=2 (``h100-2026-11-26-ws-ablations.json``, B=128, L=16k, 64-row
consumer): the producer alone 601 us, the consumer alone 603, together 782 (the read floor of
those bytes: 446). Nsight Compute (``h100-2026-11-26-ncu-ws-source.json``, B=128, L=4k): the
L1/shared pipe is the busiest unit (74%), DRAM at 42%, issue slots 35% busy; the producer's
``cp.async`` writes into the staging half show 2.6x their ideal wavefronts (10.5 a warp
instruction against 4, the same when a warp copies one key's 512 contiguous code bytes instead of
four keys' 128: not the rows' alignment; that key-by-key copy, converted 16 keys at a time, ran
0.98-1.02x, ``h200-2026-11-27-ws64-token-copies.json``). Tried at 32 rows and
not kept (``-ws64-keys.json``): with the keys-on-M consumer's smaller register need, an 8-warp
producer (80 registers) 0.95x, at 64 registers 0.96-0.99x, and 4 warps at 128 registers (no
spills) 0.98x, all bit for bit (``h100-2026-11-27-ws64-keys-producer-split.json``); a producer
staging each tile in the 40 KiB that the 32-row q frees (codes, scales and rope, a scale group
at a time, each group copied as soon as the previous tile's group has been dequantised out of
its place; scale buffers dropped), correct but 0.89x at B=128, L=16k -- its extra shared traffic
(rope copied twice) costs more than the copy latency it hides.

At h=128 the producer sets the pace from the first tile: 2.8-3.5 us a tile at B=32 (copy,
then conversion, one tile at a time; ``benchmarks/kernel_timeline.py``,
``h100-2026-11-27-fixed-cost.json``), where the consumer alone would take about 2.5. Two
producers of 2 warps each, taking alternate tiles with a buffer each (so that one converts
while the other's copies are in flight; each scale group converted in two halves of the keys
to fit 64 registers), were bit for bit the same and 0.78-0.87x over FP8 h=128, s_q 1-2, B 1-128,
L 1k-16k (``h100-2026-11-27-ws64-two-producers.json``): the conversion's throughput, not its
latency, is what two warps a tile lack. Nor does skipping the staging help: the producer
loading each tile's codes straight into registers (groups 0-1 before the buffer frees, the
rope and scales still by ``cp.async``, the bf16 tile stored once) was bit for bit the same and
0.64-0.84x (0.76-0.91x with 72 producer registers) over FP8 h=128 and h=16 x 2
(``h100-2026-11-27-ws64-codes-in-registers.json``): ``cp.async`` keeps many more bytes in flight
than 64 registers a thread can. Nor is the conversion's arithmetic what sets the pace: fp16 keys
(codes converted exactly and multiplied in fp16 by ``fp16(scale * 2**c)``, ``c`` a power of two a
tile from its largest scale, q's latent and P in fp16, the accumulator rescaled by the tiles'
factors with the softmax's ``alpha``) take two thirds of the producer's instructions a code
away, but ran 0.93-0.98x at h=128 and 0.98-1.01x at h=16 x 2, correct and within 0.016 of this
kernel's outputs (``h100-2026-11-27-ws64-fp16-keys.json``): the factor's reduction across the
producer's warps, the rope dot's separate wait or accumulator and q converted through registers
cost more than the conversion saved. Nor is it the copy latency two buffers leave in the
producer's path: 32-key tiles in three or four buffers (the producer up to three tiles ahead, in
the same shared memory) ran 0.68-0.95x over FP8 h=128 (``h100-2026-11-27-ws64-32-key-tiles.json``),
twice the tiles' hand-overs and softmax steps costing more than the deeper ring hides. Nor is it
the copy mechanism: the producer issuing each tile as TMA boxes into the same staging slots
(keys past ``seq_len`` zeroed in its conversion) was bit for bit the same and ran 0.89-0.96x with
one barrier a tile, 0.97-1.01x with one a scale group (``h100-2026-11-27-ws64-tma.json``). And the
consumer is not what this producer waits on: ``decode_wgmma_pp``'s two ping-pong warpgroups fed
by it at h=128 (each computing the scores of alternate tiles over all 64 keys) ran 0.89-0.997x
this kernel (H200, ``h200-2026-11-27-ws64-pingpong.json``). Nor can the producer copy a request's
next tile into the other buffer while it converts this one (after 0-2 of its four scale groups):
0.65-0.99x, the earlier the slower (H100, ``h100-2026-11-27-ws64-copy-ahead.json``) -- that buffer
is the one the consumer is still reading, and two tiles' copies then fly beside the conversion.
Ablations of this code (H100, ``h100-2026-11-27-ws64-ablations.json``, the kernel's CUPTI time with
the conversion or the dots left out; B=128, L=16k): at h=128 s_q=1 1460 us in all, 1000 without
the dots, 1196 without the conversion, 756 with neither; at h=16 x 2 657, 565, 511 and 506.
Neither side alone sets the pace: the conversion and the dots slow each other down. Nor can a
part's m-block programs share the conversion through L2 (each converting a quarter or half of the
scale groups into a scratch ring and copying the rest from its partners' slots once their
counters say so): bit for bit the same, 0.42-0.56x, and 0.73-0.84x with the synchronisation left
out (H100, ``h100-2026-11-27-ws64-l2-shared-conversion.json``; docs/kernel-performance.md) -- one
tile ahead, the extra store and copy lengthen each tile's chain. Run ahead of the copies with no
synchronisation at all (timing only), it reached at most 1.034x, at s_q=2.

**Staged stores.** A program whose part holds several requests pays a lot for each request
it moves on to: at h=128 s_q=1 with 32 tiles a part, B=128 L=1k (two whole requests a part,
none split) took 129.7 us in the decode kernel and B=32 L=4k (half a request a part) 111.6
(CUPTI, ``h100-2026-11-27-request-switch-fixed-cost-B*.json``); in the kernel's timeline
(``-request-switch-timeline.json``) the second request's 16 tiles and the move to it took 64.5
us against 52 for the other case's second 16 tiles, and the last result's stores 8 us (bf16
``out``) against 5.4 (an fp32 partial, twice the bytes). From the accumulator's layout a thread
stores ``out`` as 4-byte pairs, a warp instruction eight 16-byte pieces of eight rows. So the
64-row consumer writes an unsplit request's ``out`` into q's latent buffer (``[64, 512]`` of
q's dtype, which no dot reads after the request's last QK: past that tile's barrier) and stores
it from there in 16-byte vectors along whole rows (``gluon_parts.store_out_staged``); the next
request's q copy waits for the barrier at its start as before. Split requests' fp32 partials
(128 KiB, twice the buffer) keep the direct stores. Against the direct stores, in one process on
an H100 (``h100-2026-11-27-ws64-staged-out.json``, FP8 h=128, B 8-128, L 1k-16k, bit for bit
the same): 1.08x at B=128 L=1k s_q=1 (135.8 -> 125.5 us), 1.11x at B=32 L=1k s_q=2 (73.2 -> 66.2),
1.01-1.02x at B=128 s_q=2 and B=32 L=16k s_q=2, 0.99-1.00x where all requests are split -- except
at B=8, where the kernel compiled with the staged path (its consumer spilling 140 bytes instead
of 80, in the per-request set-up) ran 0.97-0.99x though it never takes it. So a launch compiles
it only when the plan's parts can hold whole requests, ``num_parts <= 2 B``
(``W64_STAGE_OUT_PARTS_PER_REQUEST``: at h=128 the 64-row configs' 66 parts at s_q=1 and 33 at
s_q=2 stage from B=33 / B=17). The same for the keys-on-M consumer (``out`` ``[32, 512]``
through q's buffer, from the transposed accumulator) ran 0.99-1.005x over FP8 h=16 s_q=2 (same
json, its h=16 rows) and is not used. Nor was the q copy the cost of the move: copying the next
request's q while a request's last PV dot and stores run (``cp.async`` issued past the last
QK's barrier, waited for at the next request's start) was bit for bit the same and 0.99-1.01x
at h=128, 0.97-0.99x at h=16 x 2 (``h100-2026-11-27-ws64-q-ahead.json``). Mutants of the staged
stores (``h100-2026-11-27-ws64-staged-out-mutants.json``, the 20 staged cases of
``test_decode_wgmma_ws64_matches_reference_gpu``): the block's row offset dropped (16 fail),
padding rows unmasked (4 fail: h=20 x 4, the rows past the request spill into the next), the
columns read back reversed (20 fail); the barrier between the buffer's store and its read-back
dropped is a race no case observed on the H100.

A split piece's fp32 partial (128 KiB, twice q's buffer) is staged too when it is the part's last
piece: the producer then has no tile left, so the two K buffers (128 KiB together) are free once the
last PV dot is done. ``gluon_parts.store_part_staged`` writes the result into them as fp32 ``[64,
512]`` (16-byte units swizzled by row, so the accumulator layout's rows do not share banks) and
reads it back a column quarter at a time in 16-byte vectors along rows. Against the direct stores,
in one process on an H100 (``h100-2026-11-27-ws64-staged-partials.json``, FP8 h=128, bit for bit
the same), with the path compiled into every launch:

- 1.003-1.035x at s_q=1, B 8-32 (B=32 L=1k 50.3 -> 48.9 us);
- 1.000-1.033x at s_q=2, B=8;
- 0.989-1.005x at B=128, and at s_q=2 B=32, where parts hold whole requests. The path is taken
  there by fewer programs, and the compiled code is slower.

So it is compiled in only for launches of at least two parts a request of the padded batch
(``W64_STAGE_PART_PARTS_PER_REQUEST``): at h=128's 66 / 33 parts, s_q=1 up to B=33 and s_q=2 up to
B=16. With every column quarter stored at the first quarter's address, the 20 staged cases of
``test_decode_wgmma_ws64_matches_reference_gpu`` fail and the 20 direct ones pass (same json).

Taken by ``decode_split.launch_decode_split`` when ``decode_wgmma.wgmma_plan`` admits a
64-row block of an FP8 cache and the ``WGMMA_WS64`` switch is on (``decode_wgmma.ws64_taken``);
``config.default_config`` gives FP8 64-row blocks of 64-key tiles with 8 warps on Hopper at
h=128 (those configs already ran ``decode_wgmma``'s kernel) and at 17-32 query rows (h=16 x
2, parts of two tiles: 0.99-1.09x the keys-on-M kernel there). A build failure falls back to the
Triton kernel as for the other Gluon kernels (``decode_wgmma.mark_unavailable``).
"""
from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_init, warpgroup_mma_wait)
except Exception:  # pragma: no cover - a Triton without Gluon: the Triton kernel only
    gluon = None

from .gluon_parts import (key_rows, part_bounds, program_rows, request_span, ring_barriers, row_copy_layout,
                          rows_tile_step, softmax_keys_step, softmax_result, start_request_rows, store_keys_lse,
                          store_keys_part, store_part_staged, store_rows_result, tile_page, wait_prior_grid,
                          wgmma_layout)
from .pdl import pdl_on

__all__ = ["launch_decode_wgmma_ws64", "W64_BUFS", "W64_PRODUCER_WARPS", "W64_PRODUCER_REGS", "W64_KEYS_ROWS",
           "W64_STAGE_OUT_PARTS_PER_REQUEST", "W64_STAGE_PART_PARTS_PER_REQUEST"]

#: tile buffers handed between the two partitions (two fill the shared memory)
W64_BUFS = 2
#: warps of the producer partition
W64_PRODUCER_WARPS = 4
#: registers a producer thread gets (the consumer gets the rest of the register file)
W64_PRODUCER_REGS = 64
#: the kernel's register cap: (8 + W64_PRODUCER_WARPS) warps x 32 threads x this <= 64K
W64_MAXNREG = 168
#: launches of at most this many query rows a request (up to 32) take the keys-on-M consumer
#: (module doc); 0 sends every launch to the 64-row one
W64_KEYS_ROWS = 32
#: warps of the keys-on-M consumer, the launch's ``num_warps``: 4 (one warpgroup, every row, the
#: K tile read once a dot: 1.00-1.05x two, module doc) or 8 (two warpgroups, half the rows each)
W64_KEYS_WARPS = 4
#: beside a one-warpgroup keys-on-M consumer (which then needs under half the register file), the
#: producer's warps and registers: 8 x 72 ran 1.03-1.06x 4 x 64 (module doc)
W64_KEYS_PRODUCER_WARPS = 8
W64_KEYS_PRODUCER_REGS = 72
#: the 64-row consumer stores unsplit requests' ``out`` through q's latent buffer in whole rows (module
#: doc, "Staged stores") in launches of at most this many parts a request of the padded batch (where
#: parts hold whole requests: 1.08-1.11x; with it compiled in, launches whose requests are all split ran
#: 0.97-0.99x); 0: never
W64_STAGE_OUT_PARTS_PER_REQUEST = 2
#: the 64-row consumer stores the fp32 partial of its part's last request through the two free K
#: buffers (module doc, "Staged stores") in launches of at least this many parts a request of the
#: padded batch (where a part's last piece is a split one: 1.003-1.035x; compiled into launches of
#: fewer parts a request, 0.989-0.998x); 0: every 64-row launch, None: never
W64_STAGE_PART_PARTS_PER_REQUEST = 2
#: the register cap with a one-warpgroup keys-on-M consumer: (4 + 8) warps x 32 threads x this <= 64K
W64_KEYS_MAXNREG = 168

if gluon is not None:

    @gluon.jit
    def _w64_copy(stage_s, stage, rope_buf, sc_buf, kv_ptr, bt_row, tile, seq_len, page0, PAGE: gl.constexpr,
                  RANK: gl.constexpr, ROPE: gl.constexpr, NG: gl.constexpr, GROUP: gl.constexpr,
                  TOKEN_STRIDE: gl.constexpr, BLOCK_N: gl.constexpr, CODE_L: gl.constexpr, ROPE_L: gl.constexpr,
                  SC_L: gl.constexpr):
        # Copy one tile into a free buffer (cp.async; keys past seq_len are masked and land as
        # zeros), in NG commit groups: the bf16 rope, the fp32 scales (token layout codes | scales
        # | rope) and the codes of scale group 0; then the codes of each further group. Group g's
        # codes go to stage_s[stage + g] ([BLOCK_N, GROUP] uint8), so that the dequantisation of
        # a group can start once its commit group has landed. The keys' pages: ``page0``
        # (``tile_page``, loaded a tile ahead) when a page holds whole tiles.
        offs_r = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ROPE_L))
        ok_r = offs_r < seq_len
        rope_at = key_rows(kv_ptr, bt_row, offs_r, ok_r, page0, PAGE, BLOCK_N, TOKEN_STRIDE) + RANK + 4 * NG
        cols_r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, ROPE_L))
        async_copy.async_copy_global_to_shared(rope_buf, rope_at.to(gl.pointer_type(gl.bfloat16))[:, None]
                                               + cols_r[None, :], mask=ok_r[:, None] & (cols_r[None, :] < ROPE))
        offs_s = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SC_L))
        ok_s = offs_s < seq_len
        sc_at = key_rows(kv_ptr, bt_row, offs_s, ok_s, page0, PAGE, BLOCK_N, TOKEN_STRIDE) + RANK
        cols_s = gl.arange(0, NG, layout=gl.SliceLayout(0, SC_L))
        async_copy.async_copy_global_to_shared(sc_buf, sc_at.to(gl.pointer_type(gl.float32))[:, None]
                                               + cols_s[None, :], mask=ok_s[:, None] & (cols_s[None, :] < NG))
        offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, CODE_L))
        ok = offs_n < seq_len
        row = key_rows(kv_ptr, bt_row, offs_n, ok, page0, PAGE, BLOCK_N, TOKEN_STRIDE)
        cols = gl.arange(0, GROUP, layout=gl.SliceLayout(0, CODE_L))
        for g in gl.static_range(NG):
            async_copy.async_copy_global_to_shared(stage_s.index(stage + g), row[:, None] + g * GROUP + cols[None, :],
                                                   mask=ok[:, None] & (cols[None, :] < GROUP))
            async_copy.commit_group()

    @gluon.jit
    def _w64_group(codes, sc, g: gl.constexpr, DT: gl.constexpr, DEQ_L: gl.constexpr, SC_L: gl.constexpr):
        # One scale group's values code * scale in fp32, rounded to DT: codes [BLOCK_N, GROUP]
        # (DEQ_L), sc the tile's scales [BLOCK_N, NG] (SC_L)
        cols = gl.arange(0, sc.shape[1], layout=gl.SliceLayout(0, SC_L))
        sc_g = gl.sum(gl.where(cols[None, :] == g, sc, 0.0), axis=1)
        sc_g = gl.convert_layout(sc_g, gl.SliceLayout(1, DEQ_L))
        return (codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * sc_g[:, None]).to(DT)

    @gluon.jit
    def _w64_dequantise(k_lat, stage_s, stage, sc_buf, NG: gl.constexpr, GROUP: gl.constexpr, DT: gl.constexpr,
                        DEQ_L: gl.constexpr, SC_L: gl.constexpr):
        # The staged codes of a tile into its bf16 K tile, in place (module doc), a scale group
        # as soon as its commit group (``_w64_copy``) has landed for every producer thread: groups 0
        # and 1 land below the staging half; group 2 over groups 0-1's codes, once every thread
        # has read those; group 3 over its own and group 2's, once every thread holds them
        gl.static_assert(NG == 4)
        async_copy.wait_group(3)
        gl.thread_barrier()
        sc = sc_buf.load(SC_L)
        k_lat.slice(0, GROUP, dim=1).store(_w64_group(stage_s.index(stage).load(DEQ_L), sc, 0, DT, DEQ_L, SC_L))
        async_copy.wait_group(2)
        gl.thread_barrier()
        k_lat.slice(GROUP, GROUP, dim=1).store(_w64_group(stage_s.index(stage + 1).load(DEQ_L), sc, 1, DT, DEQ_L, SC_L))
        async_copy.wait_group(1)
        gl.thread_barrier()
        k_lat.slice(2 * GROUP, GROUP, dim=1).store(_w64_group(stage_s.index(stage + 2).load(DEQ_L), sc, 2, DT, DEQ_L,
                                                              SC_L))
        async_copy.wait_group(0)
        gl.thread_barrier()
        c3 = stage_s.index(stage + 3).load(DEQ_L)
        gl.thread_barrier()
        k_lat.slice(3 * GROUP, GROUP, dim=1).store(_w64_group(c3, sc, 3, DT, DEQ_L, SC_L))

    @gluon.jit
    def _w64_producer(kv_ptr, bt_ptr, seq_ptr, part_ptr, nsplit_ptr, off_ptr, bt_stride, k_lat_s, k_rope_s, sc_s,
                      ready, empty, PAGE: gl.constexpr, RANK: gl.constexpr, ROPE: gl.constexpr, GROUP: gl.constexpr,
                      TOKEN_STRIDE: gl.constexpr, BLOCK_N: gl.constexpr, NB: gl.constexpr, PDL: gl.constexpr):
        wait_prior_grid(PDL)  # this partition's warps too (kernels/pdl.py)
        W: gl.constexpr = gl.num_warps()
        NG: gl.constexpr = RANK // GROUP
        DT: gl.constexpr = gl.bfloat16
        # 16-byte vectors along a row: 16 codes, 8 rope values; a key's NG scale words
        CODE_L: gl.constexpr = row_copy_layout(16, 8, W)
        # the dequantisation's codes, 8 a thread: a thread's bf16 values are one 16-byte store, and
        # the 16 threads of a row write its 16 chunks of 16 bytes, which the K tile's swizzle puts in
        # distinct banks. With CODE_L's 16 a thread (two stores, 8 threads a row) each store hit half
        # the banks: twice the ideal shared wavefronts (Nsight Compute); 8 ran 0.998-1.045x
        # (h200-2026-11-27-ws64-dequant-vec.json)
        DEQ_L: gl.constexpr = row_copy_layout(8, GROUP // 8, W)
        ROPE_L: gl.constexpr = row_copy_layout(8, 8, W)
        SC_L: gl.constexpr = row_copy_layout(NG, 8, W)
        # the K tiles' bytes as uint8 [NB * 2 * NG, BLOCK_N, GROUP]: [(2 s + 1) NG + g] group g of
        # the staging half of buffer s
        STAGE_SH: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        stage_s = k_lat_s._reinterpret(gl.uint8, [NB * 2 * NG, BLOCK_N, GROUP], STAGE_SH)
        pid_p = gl.program_id(0)
        b_first, t_first, j_first, b_end, t_end, b_last = part_bounds(part_ptr, pid_p)
        it = 0
        for b in range(b_first, b_last + 1):
            seq_len, t0, t1, nsplit, p_row = request_span(b, b_first, t_first, j_first, b_end, t_end, seq_ptr,
                                                          nsplit_ptr, off_ptr, BLOCK_N)
            bt_row = bt_ptr + b.to(gl.int64) * bt_stride
            pg = tile_page(bt_row, t0, t1, PAGE, BLOCK_N)
            for tile in range(t0, t1):
                s = it % NB
                # the next tile's page, read while this one waits and copies
                pg_next = tile_page(bt_row, tile + 1, t1, PAGE, BLOCK_N)
                # the consumer's PV dot of tile it - NB (which read this buffer) is done
                mbarrier.wait(empty.index(s), ((it // NB) & 1) ^ 1)
                stage = (2 * s + 1) * NG
                _w64_copy(stage_s, stage, k_rope_s.index(s), sc_s.index(s), kv_ptr, bt_row, tile, seq_len, pg, PAGE,
                          RANK, ROPE, NG, GROUP, TOKEN_STRIDE, BLOCK_N, CODE_L, ROPE_L, SC_L)
                pg = pg_next
                _w64_dequantise(k_lat_s.index(s), stage_s, stage, sc_s.index(s), NG, GROUP, DT, DEQ_L, SC_L)
                # the generic-proxy stores (and the copies) visible to the consumer's wgmma reads,
                # from every producer warp, before the (single) arrival
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(ready.index(s))
                it += 1

    @gluon.jit
    def _w64_take_buffer(acc, it, tile, t0, ready, empty, NB: gl.constexpr):
        # A consumer's turn to tile ``it``: the PV dot of the previous tile is done (in both
        # warpgroups, after the barrier), so its buffer goes back to the producer and P may be
        # rewritten; then this tile's buffer is waited for. Returns ``acc`` waited on.
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        gl.thread_barrier()
        if tile > t0:
            mbarrier.arrive(empty.index((it + NB - 1) % NB))
        mbarrier.wait(ready.index(it % NB), (it // NB) & 1)
        return acc

    @gluon.jit
    def _w64_consumer(q_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr, out_ptr, lse_ptr, po_ptr,
                      plse_ptr, partial_cap, qk_scale, SQ, H, q_lat_s, q_rope_s, p_s, k_lat_s, k_rope_s, ready, empty,
                      RANK: gl.constexpr, ROPE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      NB: gl.constexpr, STAGE_OUT: gl.constexpr, STAGE_PART: gl.constexpr = False):
        # [4, 2]: the four warps of a warpgroup split the 64 rows, the two warpgroups the N axis
        S_L: gl.constexpr = wgmma_layout([4, 2], BLOCK_N // 2)
        ACC_L: gl.constexpr = wgmma_layout([4, 2], RANK // 2)
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
        ROW_A: gl.constexpr = gl.SliceLayout(1, ACC_L)
        COL_A: gl.constexpr = gl.SliceLayout(0, ACC_L)
        Q_L: gl.constexpr = row_copy_layout(8, 32, 8)
        QR_L: gl.constexpr = row_copy_layout(8, 8, 8)
        # a staged fp32 partial: rows spread over the banks (16-byte units XOR the row), read back
        # in 16-byte vectors along rows
        PART_SH: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
        PART_L: gl.constexpr = row_copy_layout(4, 32, 8)

        ROWS = SQ * H
        b_first, t_first, j_first, b_end, t_end, b_last, row0, ctx_w, m_s, n_s = program_rows(
            part_ptr, ctxw_ptr, BLOCK_M, BLOCK_N, S_L)
        row_ok_s = m_s < ROWS
        tok_s = m_s // H
        it = 0
        for b in range(b_first, b_last + 1):
            b64 = b.to(gl.int64)
            seq_len, t0, t1, nsplit, p_row = request_span(b, b_first, t_first, j_first, b_end, t_end, seq_ptr,
                                                          nsplit_ptr, off_ptr, BLOCK_N)
            if t1 > t0:
                ctx = start_request_rows(q_ptr, ctx_ptr, b64, ctx_w, tok_s, row_ok_s, row0, ROWS, q_lat_s, q_rope_s,
                                         RANK, ROPE, Q_L, QR_L)

                m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)
                l_i = gl.full([BLOCK_M], 0.0, gl.float32, ROW_S)
                acc = warpgroup_mma_init(gl.full([BLOCK_M, RANK], 0.0, gl.float32, ACC_L))
                for tile in range(t0, t1):
                    s = it % NB
                    acc = _w64_take_buffer(acc, it, tile, t0, ready, empty, NB)
                    k_lat = k_lat_s.index(s)
                    acc, m_i, l_i = rows_tile_step(q_lat_s, q_rope_s, k_lat, k_rope_s.index(s), p_s, acc, m_i, l_i,
                                                   ctx, tile, n_s, seq_len, qk_scale, S_L, ROW_A)
                    it += 1
                # the last tile's buffer goes back once its PV dot is done
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                gl.thread_barrier()
                mbarrier.arrive(empty.index((it + NB - 1) % NB))

                if STAGE_PART and nsplit > 1 and b == b_last:
                    # the part's last piece: the producer has no tile left, so both K buffers are
                    # free for the fp32 partial ("Staged stores")
                    store_part_staged(acc, m_i, l_i, row0, p_row, partial_cap, po_ptr, plse_ptr, ROWS,
                                      k_lat_s._reinterpret(gl.float32, [BLOCK_M, RANK], PART_SH), ROW_S, ROW_A,
                                      PART_L)
                else:
                    # STAGE_OUT: out through q's latent buffer, free since the last tile's barrier ("Staged stores")
                    store_rows_result(acc, m_i, l_i, row0, b64, nsplit, p_row, partial_cap, out_ptr, lse_ptr, po_ptr,
                                      plse_ptr, ROWS, SQ, H, BLOCK_M, RANK, ROW_S, ROW_A, COL_A, q_lat_s, Q_L,
                                      STAGE_OUT)

    @gluon.jit
    def _w64_keys_consumer(q_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr, out_ptr, lse_ptr, po_ptr,
                           plse_ptr, partial_cap, qk_scale, SQ, H, q_lat_s, q_rope_s, p_s, k_lat_s, k_rope_s, ready,
                           empty, RANK: gl.constexpr, ROPE: gl.constexpr, BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr,
                           NB: gl.constexpr):
        # The consumer for up to BLOCK_R (32) query rows: the keys on the wgmma M axis (module doc)
        # -- S^T [keys, rows], acc^T [RANK, rows] -- so that no padding rows of a 64-row block are
        # computed. [4, CW]: a warpgroup's four warps split the keys / latent columns; with one
        # warpgroup (W64_KEYS_WARPS = 4) it holds every row and reads the K tile once a dot, with
        # two each takes half the rows (no exchange between them either way)
        CW: gl.constexpr = gl.num_warps() // 4
        MMA_L: gl.constexpr = wgmma_layout([4, CW], BLOCK_R // CW)
        KEY_L: gl.constexpr = gl.SliceLayout(1, MMA_L)
        ROW_L: gl.constexpr = gl.SliceLayout(0, MMA_L)
        Q_L: gl.constexpr = row_copy_layout(8, 32, gl.num_warps())
        QR_L: gl.constexpr = row_copy_layout(8, 8, gl.num_warps())

        ROWS = SQ * H
        b_first, t_first, j_first, b_end, t_end, b_last = part_bounds(part_ptr, gl.program_id(0))
        row0 = gl.program_id(1) * BLOCK_R
        ctx_w = gl.load(ctxw_ptr)
        r = row0 + gl.arange(0, BLOCK_R, layout=ROW_L)
        n = gl.arange(0, BLOCK_N, layout=KEY_L)
        c = gl.arange(0, RANK, layout=KEY_L)
        row_ok = r < ROWS
        tok = r // H
        it = 0
        for b in range(b_first, b_last + 1):
            b64 = b.to(gl.int64)
            seq_len, t0, t1, nsplit, p_row = request_span(b, b_first, t_first, j_first, b_end, t_end, seq_ptr,
                                                          nsplit_ptr, off_ptr, BLOCK_N)
            if t1 > t0:
                ctx = start_request_rows(q_ptr, ctx_ptr, b64, ctx_w, tok, row_ok, row0, ROWS, q_lat_s, q_rope_s, RANK,
                                         ROPE, Q_L, QR_L)

                m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, ROW_L)
                l_p = gl.full([BLOCK_N, BLOCK_R], 0.0, gl.float32, MMA_L)
                acc = warpgroup_mma_init(gl.full([RANK, BLOCK_R], 0.0, gl.float32, MMA_L))
                for tile in range(t0, t1):
                    s = it % NB
                    acc = _w64_take_buffer(acc, it, tile, t0, ready, empty, NB)
                    k_lat = k_lat_s.index(s)
                    st = gl.full([BLOCK_N, BLOCK_R], 0.0, gl.float32, MMA_L)
                    st = warpgroup_mma(k_rope_s.index(s), q_rope_s.permute((1, 0)), st, use_acc=False, is_async=True)
                    st = warpgroup_mma(k_lat, q_lat_s.permute((1, 0)), st, is_async=True)
                    st = warpgroup_mma_wait(num_outstanding=0, deps=(st, ))
                    p, alpha, m_i, l_p = softmax_keys_step(st * qk_scale, m_i, l_p, ctx, tile * BLOCK_N + n, seq_len)
                    acc = acc * alpha[None, :]
                    p_s.store(p.to(p_s.dtype))
                    fence_async_shared()
                    gl.thread_barrier()
                    acc = warpgroup_mma(k_lat.permute((1, 0)), p_s, acc, is_async=True)
                    it += 1
                # the last tile's buffer goes back once its PV dot is done
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                gl.thread_barrier()
                mbarrier.arrive(empty.index((it + NB - 1) % NB))

                l_safe, lse2 = softmax_result(m_i, gl.sum(l_p, axis=0))
                store_keys_part(acc, 0, 1.0 / l_safe, r, c, b64, nsplit, p_row, partial_cap, out_ptr, po_ptr, ROWS,
                                RANK)
                store_keys_lse(lse2, r, b64, nsplit, p_row, partial_cap, lse_ptr, plse_ptr, ROWS, SQ, H)

    @gluon.jit
    def _decode_ws64_kernel(q_ptr, kv_ptr, bt_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr,
                            out_ptr, lse_ptr, po_ptr, plse_ptr, bt_stride, partial_cap, qk_scale, SQ, H,
                            PAGE: gl.constexpr, RANK: gl.constexpr, ROPE: gl.constexpr, GROUP: gl.constexpr,
                            TOKEN_STRIDE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            NB: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                            PDL: gl.constexpr, KEYS: gl.constexpr, STAGE_OUT: gl.constexpr,
                            STAGE_PART: gl.constexpr = False):
        # BLOCK_M: a program's query rows, 64, or 32 with the keys-on-M consumer (KEYS); the launch's
        # warps: the consumer's, 8 (two warpgroups) or, keys-on-M, 4
        gl.static_assert(BLOCK_M == (32 if KEYS else 64))
        gl.static_assert(gl.num_warps() == 8 or (KEYS and gl.num_warps() == 4))
        wait_prior_grid(PDL)  # before any read of the plan (kernels/pdl.py)
        gl.static_assert(RANK // GROUP == 4)
        DT: gl.constexpr = q_ptr.dtype.element_ty
        LAT_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, RANK], DT)
        ROPE_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], DT)
        QLAT_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, RANK], DT)
        QROPE_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, ROPE], DT)
        # P [rows, keys], or P^T [keys, rows] for the keys-on-M consumer
        P_SHAPE: gl.constexpr = [BLOCK_N, BLOCK_M] if KEYS else [BLOCK_M, BLOCK_N]
        P_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for(P_SHAPE, DT)
        PLAIN_SH: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        q_lat_s = gl.allocate_shared_memory(DT, [BLOCK_M, RANK], QLAT_SH)
        q_rope_s = gl.allocate_shared_memory(DT, [BLOCK_M, ROPE], QROPE_SH)
        p_s = gl.allocate_shared_memory(DT, P_SHAPE, P_SH)
        k_lat_s = gl.allocate_shared_memory(DT, [NB, BLOCK_N, RANK], LAT_SH)
        k_rope_s = gl.allocate_shared_memory(DT, [NB, BLOCK_N, ROPE], ROPE_SH)
        sc_s = gl.allocate_shared_memory(gl.float32, [NB, BLOCK_N, RANK // GROUP], PLAIN_SH)
        ready, empty = ring_barriers(NB)
        if KEYS:
            gl.warp_specialize([
                (_w64_keys_consumer, (q_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr, out_ptr,
                                      lse_ptr, po_ptr, plse_ptr, partial_cap, qk_scale, SQ, H, q_lat_s, q_rope_s, p_s,
                                      k_lat_s, k_rope_s, ready, empty, RANK, ROPE, BLOCK_M, BLOCK_N, NB)),
                (_w64_producer, (kv_ptr, bt_ptr, seq_ptr, part_ptr, nsplit_ptr, off_ptr, bt_stride, k_lat_s, k_rope_s,
                                 sc_s, ready, empty, PAGE, RANK, ROPE, GROUP, TOKEN_STRIDE, BLOCK_N, NB, PDL)),
            ], [PRODUCER_WARPS], [PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_w64_consumer, (q_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr, out_ptr, lse_ptr,
                                 po_ptr, plse_ptr, partial_cap, qk_scale, SQ, H, q_lat_s, q_rope_s, p_s, k_lat_s,
                                 k_rope_s, ready, empty, RANK, ROPE, BLOCK_M, BLOCK_N, NB, STAGE_OUT, STAGE_PART)),
                (_w64_producer, (kv_ptr, bt_ptr, seq_ptr, part_ptr, nsplit_ptr, off_ptr, bt_stride, k_lat_s, k_rope_s,
                                 sc_s, ready, empty, PAGE, RANK, ROPE, GROUP, TOKEN_STRIDE, BLOCK_N, NB, PDL)),
            ], [PRODUCER_WARPS], [PRODUCER_REGS])


def launch_decode_wgmma_ws64(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits,
                             split_offsets, out, lse, partial_o, partial_lse, *, softmax_scale_log2: float,
                             rank: int, rope_dim: int, fp8_group: int, block_m: int, block_n: int) -> None:
    """Launch this kernel (arguments as ``decode_split.launch_decode_split``; the caller has
    checked ``decode_wgmma.wgmma_plan``). Shapes: q ``[B, s_q, h, rank + rope]`` bf16;
    kv_cache uint8 ``[num_blocks, page, rank + 4 * groups + 2 * rope]``; block_m 64, block_n
    64; the rest as the Triton launcher. Up to 32 query rows take the keys-on-M consumer in
    ``W64_KEYS_WARPS`` warps (with the producer's beside them), more the 64-row one in 8."""
    B, s_q, h, _ = q.shape
    num_parts = part_info.shape[0] - 1
    m_blocks = -(-(s_q * h) // block_m)
    # up to W64_KEYS_ROWS (at most 32) rows, one row block: the keys-on-M consumer, a 32-row q
    keys = s_q * h <= min(W64_KEYS_ROWS, 32)
    one_wg = keys and W64_KEYS_WARPS == 4
    pdl = pdl_on(q)
    _decode_ws64_kernel[(num_parts, m_blocks)](
        q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits, split_offsets,
        out, lse, partial_o, partial_lse, block_table.shape[1], partial_o.shape[0], softmax_scale_log2, s_q, h,
        PAGE=kv_cache.shape[1], RANK=rank, ROPE=rope_dim, GROUP=fp8_group, TOKEN_STRIDE=kv_cache.shape[-1],
        BLOCK_M=32 if keys else block_m, BLOCK_N=block_n, NB=W64_BUFS,
        PRODUCER_WARPS=W64_KEYS_PRODUCER_WARPS if one_wg else W64_PRODUCER_WARPS,
        PRODUCER_REGS=W64_KEYS_PRODUCER_REGS if one_wg else W64_PRODUCER_REGS, PDL=pdl, KEYS=keys,
        # (q's latent buffer is what out goes through: of out's dtype)
        STAGE_OUT=not keys and out.dtype == q.dtype and num_parts <= W64_STAGE_OUT_PARTS_PER_REQUEST * B,
        STAGE_PART=(not keys and W64_BUFS == 2 and block_m == block_n and W64_STAGE_PART_PARTS_PER_REQUEST is not None
                    and num_parts >= W64_STAGE_PART_PARTS_PER_REQUEST * B),
        num_warps=W64_KEYS_WARPS if keys else 8, maxnreg=W64_KEYS_MAXNREG if one_wg else W64_MAXNREG,
        launch_pdl=pdl)
