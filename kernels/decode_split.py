"""Split-KV MLA decode kernel (paged latent cache, grouped heads, MTP causal, FP8 cache).

Grid ``(num_parts, m_blocks)``, fixed by static config: program ``(p, mb)`` walks the KV
range the planner gave part ``p`` (possibly the tail of one request, whole requests, and
the head of another) for query rows ``mb * BLOCK_M ...``. A query row is one (MTP token,
head) pair of a request, flattened token-major, so all heads *and* all MTP tokens of a
request share every loaded latent KV tile (the point of MLA's absorbed form: one KV row
serves every head).

Per KV tile of ``BLOCK_N`` keys (``d_qk`` split as rank + rope; V is the latent part of
the same rows)::

    S   = (Q_lat @ K_lat^T + Q_rope @ K_rope^T) * scale * log2(e)
    S   = where(key visible to the row's token, S, -inf)      # bottom-right causal mask
    m'  = max(m, rowmax(S));  P = exp2(S - m');  alpha = exp2(m - m')
    l   = l * alpha + rowsum(P);  acc = acc * alpha + P @ K_lat;  m = m'

and at the end ``out = acc / l``, ``lse = (m + log2 l) * ln 2``.

FP8 caches store the latent as e4m3 codes ``C`` with one fp32 scale per group of ``GROUP``
values: ``K_lat[n, c] = C[n, c] * sc[n, g(c)]``. Since the scale is constant inside a group,
it factors out of each group's part of both products (``Q_g`` / ``C_g`` / ``acc_g``: the
columns of group g)::

    Q_lat @ K_lat^T  = sum_g  (Q_g @ C_g^T) * sc[:, g][None, :]       (scale the dot result)
    (P @ K_lat)_g    = (P * sc[:, g][None, :]) @ C_g                  (scale P, not K)

so the codes go into the tensor-core dots as they are, converted e4m3 -> the q dtype (exact:
bf16 and fp16 hold every finite e4m3 value; fp16 for bf16 queries too, see *FP16 dots*), and the fp32 scale work per tile is
``BLOCK_M x BLOCK_N`` per group instead of ``BLOCK_N x RANK`` — no per-element dequantise,
no ``[BLOCK_N, groups, GROUP]`` reshape. Triton has no tensor slicing, so this
*grouped-dot* path holds the latent in four quarters (``q0..q3`` / ``acc0..acc3``, each
``[BLOCK_M, RANK / 4]``; the total stays ``[BLOCK_M, RANK]`` fp32) loaded by pointer
offsets; it applies when a quarter lies inside one group (``groups in {1, 2, 4}``: both
shipped specs have 4; 1 and 2 make tokens that ``check_spec_supported`` refuses for the GPU)
and a quarter is a legal dot dim (``RANK / 4 >= 16``). Quarter j
takes scale word ``j * groups // 4``. ``P * sc`` is rounded to the q dtype for the PV dot
(a rounding comparable to the former rounding of the dequantised K), after a fixed
``2**8`` factor — undone exactly at the end — that keeps it out of fp16's subnormal range
(scales are ``amax / 448``, typically ~1e-2). The scores' scaling happens in fp32 on the
dot results, so QK is as exact as the fp32 reference up to summation order.

*FP16 dots* (``FP8_FP16_DOTS``, grouped path, bf16 queries; fp16 queries already take
fp16 dots, fp32 queries keep fp32). Converting the codes to bf16 costs several instructions
per pair on sm_90 while e4m3 -> fp16 is one ``cvt.rn.f16x2.e4m3x2`` per two codes, and the
FP8 kernel is issue-bound (Nsight Compute: ~12 warp instructions per 32 cached codes; see
"TMA path" below). So the codes go to fp16 (exact: fp16 holds every finite
e4m3 value too) and so must the other dot operands:

- q's latent quarters are converted to fp16 once per request, after multiplying each query
  row by a power of two ``qs = 2**k``, ``k <= 0``, that brings the row's ``max |q_lat|`` below
  ``2**15`` (fp16's largest finite value is 65504): ``k = min(0, 14 - E)`` with ``E`` the
  exponent of the row max, taken from the fp32 bit pattern (an integer max over the four
  quarters of ``bits & 0x7FFFFFFF`` — NaN-proof: a NaN or inf row gets ``E = 128``, a zero
  or masked row ``k = 0``, so ``qs`` is always a finite normal power of two). Rows below
  ``2**15`` — the typical case — are not scaled at all, and then ``q -> fp16`` is exact for
  every bf16 value in fp16's normal range (bf16's 8-bit significand fits fp16's 11 bits).
  Only values under ``2**-14`` (after scaling) lose bits to fp16's subnormals and under
  ``2**-25`` flush to 0: an absolute error of at most ``2**-25`` per element (times ``qs**-1``),
  i.e. ``2**-39`` of a scaled row's max, and for an unscaled row ``<= 2**-25 * sum|K|``
  on a score — far below the rounding of q to bf16 itself (``2**-9`` relative).
- The latent part of the scores is multiplied by ``1 / qs`` per row (exact: a power of two,
  so ``S_lat`` has the bits the unscaled products would have summed to) before the rope dot
  is added; the rope dot stays bf16 (``k_rope`` is bf16 in the cache).
- ``P * sc_j * 2**8`` is rounded to fp16 for the PV dot. ``PV_SCALE`` keeps it out of fp16's
  subnormals (above); the top of fp16's range caps ``sc_j * 2**8 <= 65504``, i.e. a scale
  group's ``amax <= 448 * 255.9 ~ 1.1e5`` — as it already did for fp16 queries; latent
  values come out of a layer norm, O(1-10).

Under the interpreter (``DOT_F32``: fp32 dot operands) the switch runs the same steps —
the row scaling and its undoing, q and ``P * sc`` rounded to fp16 and back to fp32 — so the
CPU tests cover them; the codes go straight to fp32 (the same values).
Other group counts (or ``FP8_GROUPED_DOTS = False``, for benchmarks and tests) take the
*dequantise* path: e4m3 -> fp32 times the group scale through a ``[BLOCK_N, groups, GROUP]``
view, cast to the q dtype, then the same dots as a 16-bit cache. Rope is bf16 in both.

Hiding the load latency of FP8 tiles. Triton's software pipeliner (``num_stages >= 2``)
turns a load into an asynchronous copy to shared memory issued stages ahead only when all
of the load's dot uses agree on one shared-memory layout; a code tile converted and then
used by both dots (as ``K^T`` for QK, as ``K`` for PV) does not qualify, so its load stays
synchronous, every tile waiting out a full memory round trip (both FP8 paths, in the TTGIR
that Triton 3.9 makes for sm_90; a 16-bit cache's tile is pipelined). Two remedies, picked
on the host:

- *twin loads* (grouped path, ``num_stages >= 2``, no ``fp8_prefetch``, ``BLOCK_M <= 32``;
  module switch ``FP8_TWIN_LOADS``): each code tile is loaded twice, once per dot, so each
  load has one use and is pipelined. The second read of the same bytes should be served
  by L2 (DRAM traffic unchanged, L2->SM traffic ~1.8x); the two loads carry different eviction
  hints (``evict_last`` / ``evict_first``), which also keeps the compiler from merging
  them. Row blocks of 64 (wgmma, operands staged in shared memory) would exceed the 227 KiB
  of shared memory with twin buffers at ``block_n = 64`` (281 KiB for sm_90), so they load once.
- ``FP8_PREFETCH`` (``DecodeConfig.fp8_prefetch``, both FP8 paths; pair with
  ``num_stages=1``): tile ``i+1``'s bytes (codes, scales, rope) are loaded into registers
  while tile ``i`` is computed, at the price of holding a tile in registers.

Both are ignored for 16-bit caches, whose tiles feed the dots directly and are pipelined.

TMA path (``FP8_TMA``, decided on the host by ``fp8_tma_plan``; both FP8 paths). The FP8
tiles are fetched by Hopper's TMA engine through tensor descriptors, asynchronously into
shared memory. Triton's pipeliner takes a descriptor load for multi-buffering whatever
its uses are: ``isPipeliningBeneficial`` in ``Pipeliner/AssignLatencies.cpp`` returns true
for ``DescriptorLoadOp`` before the shared-layout agreement test that stops the code-tile
pointer loads (so in every version of that file read, from the ``ExperimentalDescriptorLoadOp``
era to the current one), so with ``num_stages = S`` each tile's boxes get latency ``S - 1``:
issued ``S - 1`` tiles ahead into a ring of shared-memory buffers. The scalar block-table load
that finds the tile's page is too small to pipeline and stays in the loop (an L2 hit, while
the boxes already issued keep streaming).

What it bought on an H100 was small (``benchmarks/results/h100-2026-11-26-fp8-tma.json``):
1.02-1.07x at 16 rows, 0.90-0.96x at 32. Load latency is not what holds FP8 back: Nsight
Compute on the 16-row kernel (B=128, L=4k) shows 255 registers per thread with heavy local
spilling, one 8-warp program per SM, an issue slot busy 30% of cycles, and about 12 warp
instructions per 32 cached codes (conversion, scaling and layout shuffles) — the per-tile
ALU and register work, not the memory system, sets its 30% of copy bandwidth. With TMA and
8 warps the 16-row kernel no longer spills (254 registers, 0 spills) and runs no faster;
no swept alternative (block_n 32/64, 4/8 warps, 3-6 stages, either FP8 path) beat the
shipped configs (``h100-2026-11-26-fp8-tma-sweep.json``).

- Geometry: a tile of ``BLOCK_N`` keys starts at a multiple of ``BLOCK_N`` within its
  request (planner), so when ``BLOCK_N`` divides ``page_size`` it lies inside one page and
  is one 2-D box of the cache viewed as ``[num_blocks * page_size, bytes_per_token]``, at
  row ``page * page_size + offset``. Three descriptors over dtype views of the same bytes,
  each limited to its region of a token (``_fp8_tma_descriptors``): uint8 codes (boxes of a
  ``RANK / 4`` quarter on the grouped path; of the whole ``RANK`` row on the dequantise path,
  which Triton issues as several copies since a TMA box dim is at most 256 elements —
  triton-lang/triton#6776, merged May 2025, before 3.4), fp32 scales (``[BLOCK_N, groups]`` at column
  ``RANK / 4``; the grouped path picks quarter j's word out by a masked row sum) and bf16
  rope (``[BLOCK_N, ROPE]`` at column ``(RANK + 4 groups) / 2``).
- Constraints, checked by ``fp8_tma_plan`` (any failing -> the pointer path, with the
  reason): FP8 cache, CUDA compute capability >= 9 (or ``FP8_TMA_ANY_DEVICE``, e.g. the
  interpreter), ``block_m <= TMA_MAX_BLOCK_M`` (16: measured faster only there, see the constant), contiguous cache with the codes/scales/rope token layout,
  ``page_size % block_n == 0``, ``block_n <= 256``, fewer than ``2**31`` rows (int32
  coordinates), 16-byte aligned base, row stride (bytes per token) a multiple of 16, every
  box a power of two >= 16 bytes wide starting at a 16-byte aligned column.
- Masking: a box holds whole rows, including the rows past the request's length inside
  the page (stale or never-written slots; the fuzzer poisons them with NaN). The pointer
  path never loads those (masked, ``other=0``); here they arrive, and the kernel zeroes
  their codes, scales and rope after the load. The codes and scales are essential: P is 0
  for such keys, but ``0 * NaN = NaN`` inside ``P @ V`` (and the scale enters ``P * sc``).
  The rope only reaches scores that ``where(visible, s, -inf)`` replaces; it is zeroed all
  the same. TMA's zero fill of rows past the tensor's end is not relied on.
  (Under the interpreter an e4m3 NaN byte decodes as 480, not NaN — the tests restore NaN
  with a fixture to see a missing code mask.)
- Stages: ``DecodeConfig.num_stages`` as given when >= 2; ``num_stages = 1`` (the register
  prefetch configs: the prefetch is off on this path, as are twin loads) is read as
  ``FP8_TMA_STAGES``; the depth is cut so that ``num_stages * block_n * bytes_per_token``
  fits ``FP8_TMA_SMEM_BUDGET``.
- Descriptors are host objects made by the launcher from ``kv_cache`` at every launch
  (inside the custom op); a captured CUDA graph bakes them in by value, the same staleness
  as the raw pointer it would bake otherwise.

Each piece ends in one of two stores: a request that is not split writes its final
``out`` (q dtype) and ``lse`` directly; a split request writes an fp32 partial (normalised
output + base-2 LSE) into its row of the partial buffer for the combine kernel. Tokens with
no visible key get out 0 / lse -inf explicitly (``l == 0`` guarded, never 0/0). Both are
scalar ``if`` branches on the request's uniform ``nsplit`` (and ``p_row < partial_cap``
for partials), taken only when the request has a tile in this part (``t1 > t0``; an empty
request, or a stale plan, stores nothing). On an H100 the branches made the bf16 s_q=2
decode 1.10x faster than the former masked stores of both kinds (h=16, B 32/128, L 16k).
Under ``TRITON_INTERPRET=1`` (``SKIP_EMPTY``) a request without a tile also skips its whole
body -- q loads, loop, epilogue: every executed op costs 15-20 us there whatever its size,
and the fuzzer's padded rows are such requests. That outer branch is compiled out on the
GPU, where it cost 5-10% at s_q=2 (same cases).

The page size is a compile-time constant (``PAGE``). Each tile maps its keys to cache rows
through ``offs_n // PAGE`` and ``offs_n % PAGE``; with the page size a runtime argument those
were signed integer divisions, and Nsight Compute's per-instruction counts on an H100 put
about 40% of the bf16 decode's executed instructions in integer arithmetic (``IMAD``,
``IABS``, ``IMAD.HI``, ``SEL``, ...: the division sequence) while the kernel is bound by
instruction latency (two warps per scheduler). As a constant -- a power of two in every
deployment -- they are a shift and a mask. One kernel is compiled per page size a process
uses. Same H100, one command, old and new code
(``benchmarks/results/h100-2026-11-26-kernel-pageconst-{before,after}.json``): bf16 h=128
1.04-1.15x, bf16 h=16 s_q=1 1.05-1.12x, bf16 h=16 s_q=2 0.97-1.07x, FP8 h=16 1.00-1.03x.

P through memory (``P_MEM``, FP8 caches on the dequantise path in 64-row blocks, i.e.
h=128, and the FP8 default at 17-32 query rows, h=16 at s_q=2, whose 64-row block is half
padding; ``fp8_p_via_memory``). Triton gives a dot whose result reaches another dot all the
warps along M (``warpsPerTileV3`` in its ``AccelerateMatmul``: any dot in the forward slice
of the result), and 64 rows fill one warpgroup, so with 8 warps both warpgroups compute the
same ``Q K^T`` tile (72 ``HGMMA.64x32x16`` a warp a tile: the whole S each). Here each tile's
P (rounded to the dot dtype, as before) and alpha go through a per-program scratch slot in
global memory (``BLOCK_M x BLOCK_N`` values + ``BLOCK_M`` fp32; an L2-resident 16 KiB at
128-key tiles) between two CTA barriers, so nothing the PV dot reads -- P, or the alpha that
rescales its accumulator -- derives from the QK result; the rope dot is issued first and the
latent dot accumulates onto it, so the big dot's result feeds no dot either. Triton then lays
the latent QK out ``[4, 2]``: each warpgroup computes half the tile's keys (TTGIR on an H100,
Triton 3.6). The two barriers stop Triton's software pipeliner from pipelining the loop's
loads, which costs nothing on this path (its code tiles are loaded synchronously anyway,
"Hiding the load latency" above) and 1.3x on the bf16 path (pipelined cp.async tiles), which
keeps the duplicated QK (``h100-2026-11-26-pmem-bf16-ab.json``). Same H100, one command
(``benchmarks/fp8_decode_bench.py --pmem``, ``h100-2026-11-26-fp8-pmem.json``; h=128, s_q 1/2,
B 32/128, L 1k-16k): at 128-key tiles and one stage 1.04-1.12x over the same config without
it and 1.05-1.14x over the former 64-key / 2-stage default, which it replaced; at 64-key
tiles it is level (0.97-1.01x). The slot is written before it is read in every tile and never
read across launches, so the launcher allocates it afresh per launch (graph-capture safe).
At 32 query rows (h=16, s_q=2) this 64-row wgmma kernel, half its rows padding, beat the
32-row grouped kernel (``mma.sync``, warps ``[1, 8]``: the 8 warps split the keys, so each
needs the whole 32 x 576 q block as its dot operand, more than its registers hold):
1.02-1.30x, geo-mean 1.11, same H100, one command
(``h100-2026-11-26-kernel-6-before-0236ef3.json`` / ``-kernel-6.json``); at 16 rows it lost
(0.94x at B=128, L=16k, ``h100-2026-11-26-fp8-m64-h16.json``).

Hopper at 64-row blocks. On a GPU of compute capability 9.x, a launch of 64-row blocks of
64-key tiles runs the Gluon kernel of ``kernels/decode_wgmma.py`` instead of this one (its
``wgmma_plan`` decides; ``WGMMA_DECODE`` switches it off): it splits both dots over the two
warpgroups, hands P over through shared memory and keeps the PV dot in flight across the next
tile's copies -- 1.14-1.47x this kernel on bf16 h=128 (its module doc); FP8 blocks go to its
warp-specialised counterpart, ``kernels/decode_wgmma_ws64.py`` (a producer partition
dequantises the next tile while the dots run), and 16-bit ones of two or more row blocks (and
16+ request x row-block pairs) to the ping-pong ``kernels/decode_wgmma_pp.py`` (its two
warpgroups on alternate tiles; ``decode_wgmma.pp_taken``). There the CUDA defaults
(``config.default_config``) give them h=128 (bf16, fp16, FP8); h=16 FP8 (16-32 rows, bf16
queries) takes the few-row Gluon kernels (``kernels/decode_wgmma_keys.py`` and its successors:
the same plan, keys on the wgmma M axis), h=16 bf16 / fp16 the TMA one of
``kernels/decode_wgmma_kt.py``. This kernel still serves every other launch (fp16 queries on
an FP8 cache, 16-bit caches TMA cannot copy, configs the Gluon kernels are not written for),
every other GPU and the interpreter, and the notes below on 64-row blocks and on the FP8 paths at h=16
describe it (measured with the Gluon kernels off or before they existed).

Known limits on an H100 (Nsight Compute, per-instruction counts; not fixed here):

- 64-row bf16 blocks (h=128) keep the duplicated ``Q K^T`` (above): about 38% of the measured
  bf16 matmul rate at s_q=2; 4 warps would hold the ``[64, 512]`` fp32 accumulator in 256
  registers a thread, and P through memory stops the pipeliner (1.3x slower). With an
  inline-asm barrier that the pipeliner does not see, the TTGIR had both the split QK
  (``[4, 2]``) and the pipelined tile loads, and it ran no faster (0.99-1.01x,
  ``h100-2026-11-26-pmem-variants.json``). Nsight Compute on the shipped kernel (h=128,
  s_q=2, B=32, L=4k; ``benchmarks/results/ncu/h100-2026-11-26-ncu_bf16_128_2_32_4096.txt``)
  puts a quarter of the warp stall samples on ``WARPGROUP.DEPBAR`` (waiting for the wgmma
  results) and a tenth on the wgmma issue itself: the loop is serial (QK, softmax, PV, rescale) in every
  warpgroup, which is what FlashMLA's hand-split warpgroups overlap.
- 16/32-row blocks of bf16 at 128-key tiles: one tile buffer (147 KiB) per program and one
  program per SM, so a program loads, then computes. Long requests still reach 88-97% of
  copy bandwidth (programs drift out of step and share the memory system); short batches
  run in lock step.
- Swapping the dots (``K @ q^T``, so the key tile is the wgmma M) was tried in this kernel
  and was no faster (0.85-1.02x bf16, 0.2-0.87x FP8; still 255 registers a thread;
  ``benchmarks/results/h100-2026-11-26-swap-dots.json``). Written in Gluon, with the layouts,
  the conversion and the loads stated, the same idea is the FP8 few-row kernel
  (``kernels/decode_wgmma_keys.py``: 1.27-1.49x at B=128 over the 64-row Gluon kernel).
- FP8 twin loads with the V copy converted by a non-pure inline-asm ``cvt.rn.f16x2.e4m3x2``
  in the load layout (so fp16, not bytes, goes through shared memory to the PV dot's
  operand layout; Triton otherwise gathers the codes byte by byte in that layout): level,
  0.97-1.03x (``h100-2026-11-26-fp8-v-asm.json``); not kept. Converting every code tile so
  (K too) made the 64-key TMA config at 16 rows 1.07-1.15x faster, but only level with the
  shipped 128-key config (0.96-1.02x), and the fp16 tiles in shared memory no longer fit
  128-key tiles or 32-row twin loads (``h100-2026-11-26-fp8-k-asm.json``).
- Triton's automatic warp specialization (``tl.range(..., warp_specialize=True)`` on the
  tile loop, Triton 3.6 on sm_90): the loop kept its attribute but was not partitioned;
  same kernel, same times (``h100-2026-11-26-warp-specialize.json``).
- FP8 64-row blocks with the code tiles pipelined: P through memory's two barriers as
  inline-asm ``bar.sync`` that the pipeliner does not see, so 64-key tiles at 2-4 stages get
  cp.async loads with the split QK: 1.02-1.16x slower than the shipped one-stage 128-key
  kernel (``h100-2026-11-26-fp8-pmem-pipelined.json``); the FP8 tile's cost is its
  dequantisation (per code: e4m3 -> f16 -> f32, times the scale, -> bf16) and dots, not an
  exposed load.
- bf16 64-row blocks at the FP8 shape (128-key tiles, one stage, with or without P through
  memory): 1.6-2.0x slower than the pipelined 64-key / 2-stage default
  (``h100-2026-11-26-bf16-h128-bn128.json``).
- Lazy rescaling on the 16-bit path (the rows' reference max, and so the accumulator's
  rescale, moves only when some row's max grew by more than 2**8, a block-wide branch):
  h=128 1.12-1.16x slower, h=16 level (``h100-2026-11-26-lazy-rescale.json``).

Interpreter note: ``tl.dot`` on bf16/fp16 operands returns garbage under
``TRITON_INTERPRET=1`` (triton #11584), so ``DOT_F32`` upcasts the operands to fp32
(decided on the host); on the GPU bf16/fp16 operands feed the tensor cores directly.

Extension point (sparse top-k decode, later issue): the blocks marked "key positions ->
cache slots" are the only places that map key positions to cache slots; the sparse variant
reads the slots from ``indices`` (``-1`` -> masked) instead of the block table, with
per-token key counts from ``topk_length`` in place of ``ctx_lens``, and the planner counts
``ceil(topk / block_n)`` tiles per request instead of ``ceil(seq_len / block_n)``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .config import interpreting
from .decode_wgmma import launch_decode_wgmma, mark_unavailable, pp_taken, rs_plan, wgmma_plan, ws64_taken
from .decode_wgmma_pp import launch_decode_wgmma_pp
from .decode_wgmma_keys import launch_decode_wgmma_keys
from .decode_wgmma_kt import launch_decode_wgmma_kt
from .decode_wgmma_rs import launch_decode_wgmma_rs
from .decode_wgmma_ws import launch_decode_wgmma_ws
from .decode_wgmma_ws64 import launch_decode_wgmma_ws64
from .pdl import grid_wait, launch_options, pdl_on
from .rounding import to_out

try:  # Triton's compile / resource errors (a Gluon kernel that fails to build, below)
    from triton.errors import TritonError
except ImportError:  # pragma: no cover - an older Triton, without Gluon either: nothing to catch
    TritonError = ()

try:  # host-side TMA descriptors (Triton >= 3.3; the same class in 3.6 and 3.9)
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # pragma: no cover - an older Triton: the pointer path only
    TensorDescriptor = None

__all__ = ["launch_decode_split", "fp8_grouped_dots", "fp8_p_via_memory", "fp8_tma_plan", "TmaPlan"]

_LOG2E = 1.4426950408889634

#: Use the grouped-dot FP8 path wherever the spec allows it (module doc). A module switch
#: read at every launch rather than a ``DecodeConfig`` field: it picks an implementation,
#: not a tuning knob. ``benchmarks/fp8_decode_bench.py`` and the tests set it to False to
#: time / exercise the dequantise path on the shipped specs.
FP8_GROUPED_DOTS = True
#: Grouped-dot path without ``fp8_prefetch``, with ``num_stages >= 2`` and ``block_m <= 32``:
#: load each code tile twice, once per dot (module doc, "twin loads"). A module switch for
#: the same reason.
FP8_TWIN_LOADS = True


#: Grouped-dot path with bf16 queries: feed the tensor-core dots fp16 operands (codes -> fp16
#: in one instruction per pair on sm_90, q scaled per row by a power of two into fp16's range,
#: ``P * sc`` rounded to fp16) instead of bf16 ones (module doc, "FP16 dots"). A module switch
#: like ``FP8_GROUPED_DOTS``: ``benchmarks/fp8_decode_bench.py --f16`` and the tests turn it
#: off / on.
FP8_FP16_DOTS = True


#: Under the interpreter, skip the whole per-request body of a request without a tile in the
#: part (module doc, the stores). Always off on the GPU; a test turns it off on CPU to run
#: the GPU's structure there.
SKIP_EMPTY_ON_INTERPRETER = True


#: Fetch FP8 cache tiles through TMA tensor descriptors where ``fp8_tma_plan`` allows it
#: (module doc, "TMA path"): on CUDA devices of compute capability >= 9 (Hopper has the TMA
#: engine; Triton lowers descriptor loads to plain loads elsewhere). A module switch like
#: ``FP8_GROUPED_DOTS``: ``benchmarks/fp8_decode_bench.py`` and the tests turn it off / on.
FP8_TMA = True
#: Take the TMA path on any device where its constraints hold — the interpreter included
#: (it executes descriptor loads), so the CPU suite covers the path's logic. Off by default.
FP8_TMA_ANY_DEVICE = False
#: Pipeline depth of the TMA path when the config says ``num_stages=1``: that value belongs
#: to the register-prefetch configs (``fp8_prefetch``), which the TMA path replaces, and an
#: unpipelined TMA load would wait out every tile's round trip. ``num_stages >= 2`` is used
#: as given (within ``FP8_TMA_SMEM_BUDGET``).
FP8_TMA_STAGES = 3
#: Shared memory the TMA path's tile buffers may take: ``num_stages`` buffers of
#: ``block_n * bytes_per_token`` each (656 B a key at DeepSeek size: 41 KiB at block_n=64).
#: Deeper pipelines are cut to fit; the rest of H100's 227 KiB is left for Triton's
#: layout-conversion scratch.
FP8_TMA_SMEM_BUDGET = 176 * 1024
#: Largest row block that takes the TMA path. Measured on an H100 (h=16, B 32/128, L 1k-16k,
#: ``benchmarks/results/h100-2026-11-26-fp8-tma.json``): at 16 rows TMA was 1.02-1.07x the
#: pointer path with its register prefetch, at 32 rows (the grouped path of s_q=2) 0.90-0.96x,
#: so 32-row blocks keep the pointer path (re-measured with fp16 dots and the page-size
#: constant: 0.91-0.92x, ``h100-2026-11-26-fp8-recheck.json``). 64-row blocks (h=128) could not take it anyway:
#: they stage their wgmma operands in shared memory as well (``q_lat`` and the converted K,
#: 64 KiB each at rank 512), leaving no room for two tile buffers.
TMA_MAX_BLOCK_M = 16


#: P through memory (module doc): FP8 caches on the dequantise path with ``block_m >=
#: P_MEM_MIN_BLOCK_M`` (h=128) hand P and alpha to the PV dot through a per-program scratch
#: slot, so that the QK tile is not computed by both warpgroups. A module switch like
#: ``FP8_GROUPED_DOTS`` (benchmarks and tests turn it off / on).
P_VIA_MEMORY = True
#: Smallest row block that takes it: one warpgroup's wgmma covers 64 rows, so only 64-row
#: blocks had both warpgroups computing the same scores.
P_MEM_MIN_BLOCK_M = 64


#: Largest row block that takes the grouped-dot path: at 64 rows (h=128) its four
#: ``[BLOCK_M, RANK/4]`` accumulators and operands spill, and it ran 1.8x slower than the
#: dequantise path on an H200 (h=128, s_q=2, B=128, L=16k: 9.9 vs 5.4 ms,
#: benchmarks/results/h200-2026-11-26-kernel-fp8-paths.json). With fp16 dots and the
#: page-size constant it draws level on an H100 (0.98-1.01x; ``h100-2026-11-26-fp8-recheck.json``),
#: still not faster, so 64-row blocks keep dequantising.
GROUPED_MAX_BLOCK_M = 32


def fp8_grouped_dots(rank: int, fp8_group: int, block_m: int = 16) -> bool:
    """True when an FP8 cache of this shape takes the grouped-dot path (module doc): every
    latent quarter lies inside one scale group and is a legal ``tl.dot`` dim, and the row
    block is small enough for the per-quarter accumulators (``GROUPED_MAX_BLOCK_M``)."""
    groups = rank // fp8_group
    return (bool(FP8_GROUPED_DOTS) and groups in (1, 2, 4) and rank % 4 == 0 and rank // 4 >= 16
            and block_m <= GROUPED_MAX_BLOCK_M)


def fp8_p_via_memory(fp8: bool, grouped: bool, block_m: int) -> bool:
    """True when the decode hands P to the PV dot through its scratch slot (module doc, "P
    through memory"): an FP8 cache on the dequantise path in row blocks of at least
    ``P_MEM_MIN_BLOCK_M``, with the ``P_VIA_MEMORY`` switch on."""
    return bool(P_VIA_MEMORY) and fp8 and not grouped and block_m >= P_MEM_MIN_BLOCK_M


@dataclass(frozen=True)
class TmaPlan:
    """The host's decision on the FP8 TMA path for one launch: ``use`` it or not, the
    ``num_stages`` to compile with when used, and why (``reason``: the first constraint
    that failed, or what was decided)."""

    use: bool
    num_stages: int
    reason: str


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return tuple(torch.cuda.get_device_capability(index))


def _device_capability(device: torch.device) -> Optional[tuple]:
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def fp8_tma_plan(kv_cache: torch.Tensor, *, rank: int, rope_dim: int, fp8_group: int, block_m: int,
                 block_n: int, num_stages: int, capability: Optional[tuple] = None) -> TmaPlan:
    """Whether the FP8 decode fetches its cache tiles through TMA descriptors (module doc,
    "TMA path"), and with how many pipeline stages. Host-side and static (shapes, strides,
    alignment, device): a captured graph's kernel choice depends only on capture-time facts.

    ``capability``: the device's compute capability; None reads it from ``kv_cache``'s device
    (None for a CPU tensor). Passing it lets tests ask what a CUDA device would get.
    Every constraint of the path is checked here; the first that fails is the ``reason``
    and the pointer path runs instead.
    """
    def no(reason: str) -> TmaPlan:
        return TmaPlan(False, num_stages, reason)

    if kv_cache.dtype != torch.uint8:
        return no("not an FP8 cache")
    if not FP8_TMA:
        return no("FP8_TMA is off")
    if TensorDescriptor is None:
        return no("this Triton has no triton.tools.tensor_descriptor")
    cap = capability if capability is not None else _device_capability(kv_cache.device)
    if not FP8_TMA_ANY_DEVICE and (cap is None or tuple(cap) < (9, 0)):
        return no(f"device without TMA (compute capability {cap})")
    if block_m > TMA_MAX_BLOCK_M:
        return no(f"block_m {block_m} > TMA_MAX_BLOCK_M {TMA_MAX_BLOCK_M}")
    if kv_cache.dim() != 3 or not kv_cache.is_contiguous():
        return no("cache not a contiguous [num_blocks, page_size, bytes_per_token] tensor")
    nb, page, token = kv_cache.shape
    ng = rank // fp8_group if fp8_group > 0 else 0
    if ng < 1 or rank % fp8_group or token != rank + 4 * ng + 2 * rope_dim:
        return no("token layout is not codes + fp32 scales + bf16 rope")
    # a tile of block_n keys must lie inside one page: tiles start at multiples of block_n
    # within a request (planner), so block_n | page_size suffices
    if page % block_n:
        return no(f"page_size {page} not a multiple of block_n {block_n}")
    if block_n > 256:
        return no(f"block_n {block_n} > 256 rows")
    if nb * page >= 2 ** 31:
        return no("more than 2**31 cache rows (TMA coordinates are int32)")
    # TMA: 16-byte aligned base, row strides of 16-byte multiples, boxes >= 16 bytes wide
    # starting at 16-byte aligned columns (the interpreter checks the same)
    if kv_cache.data_ptr() % 16:
        return no("cache base not 16-byte aligned")
    if token % 16:
        return no(f"bytes per token {token} not a multiple of 16")
    # (both code box widths are checked: the launcher picks the grouped or dequantise path)
    for what, nbytes in (("code quarter", rank // 4), ("code row", rank), ("scale row", 4 * ng),
                         ("rope row", 2 * rope_dim)):
        if nbytes < 16 or nbytes & (nbytes - 1):
            return no(f"{what} of {nbytes} bytes: a TMA box needs a power of two >= 16 bytes")
    if rank % 16 or (rank + 4 * ng) % 16:
        return no("scale or rope columns not 16-byte aligned in the token")
    stages = num_stages if num_stages >= 2 else FP8_TMA_STAGES
    fit = max(2, FP8_TMA_SMEM_BUDGET // (block_n * token))
    if stages > fit:
        return TmaPlan(True, fit, f"TMA, num_stages {stages} cut to {fit} (FP8_TMA_SMEM_BUDGET)")
    return TmaPlan(True, stages, f"TMA, num_stages {stages}")


def _fp8_tma_descriptors(kv_cache: torch.Tensor, *, rank: int, rope_dim: int, fp8_group: int, block_n: int,
                         grouped: bool) -> tuple:
    """Three descriptors over dtype views of the same cache, seen as ``[rows, token bytes]``
    (``rows = num_blocks * page_size``), each limited to its region of a token: uint8 codes
    ``[rows, rank]`` (boxes of a latent quarter on the grouped path, of the whole row on the
    dequantise path — Triton splits a box wider than the hardware's 256 elements into
    several copies), fp32 scales ``[rows, rank/4 + groups]`` (box: the row's ``groups``
    words at column ``rank/4``) and bf16 rope ``[rows, (rank + 4 groups)/2 + rope]`` (box at
    column ``(rank + 4 groups)/2``)."""
    nb, page, token = kv_cache.shape
    rows = nb * page
    ng = rank // fp8_group
    flat = kv_cache.view(rows, token)
    f32 = flat.view(torch.float32)
    b16 = flat.view(torch.bfloat16)
    codes = TensorDescriptor(flat, shape=[rows, rank], strides=[token, 1],
                             block_shape=[block_n, rank // 4 if grouped else rank])
    scales = TensorDescriptor(f32, shape=[rows, rank // 4 + ng], strides=[token // 4, 1], block_shape=[block_n, ng])
    rope = TensorDescriptor(b16, shape=[rows, (rank + 4 * ng) // 2 + rope_dim], strides=[token // 2, 1],
                            block_shape=[block_n, rope_dim])
    return codes, scales, rope


@triton.jit
def _decode_split_kernel(q_ptr, kv_ptr, bt_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr,
                         out_ptr, lse_ptr, po_ptr, plse_ptr, codes_desc, scales_desc, rope_desc,
                         pscr_ptr, ascr_ptr, bt_stride, partial_cap, qk_scale, SQ, H, PAGE: tl.constexpr,
                         RANK: tl.constexpr, ROPE: tl.constexpr,
                         GROUP: tl.constexpr, TOKEN_STRIDE: tl.constexpr, FP8: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
                         DOT_PREC: tl.constexpr, FP8_PREFETCH: tl.constexpr, GROUPED: tl.constexpr,
                         TWIN: tl.constexpr, K_EVICT: tl.constexpr, USE_TMA: tl.constexpr,
                         F16_DOTS: tl.constexpr, SKIP_EMPTY: tl.constexpr, P_MEM: tl.constexpr,
                         PDL: tl.constexpr = False):
    if PDL:  # before any read of the plan (kernels/pdl.py)
        grid_wait()
    pid_p = tl.program_id(0)
    pid_m = tl.program_id(1)
    ROWS = SQ * H
    D: tl.constexpr = RANK + ROPE
    LN2: tl.constexpr = 0.6931471805599453
    NG: tl.constexpr = RANK // GROUP
    ROPE_OFF: tl.constexpr = RANK + 4 * NG   # FP8 token: codes, NG fp32 scales, bf16 rope
    # grouped-dot path: the latent in quarters of QW columns; quarter j uses scale word Gj
    QW: tl.constexpr = RANK // 4
    G1: tl.constexpr = NG // 4
    G2: tl.constexpr = NG // 2
    G3: tl.constexpr = (3 * NG) // 4
    # P * scale is taken 2**8 larger (out of fp16's subnormals) and acc 2**-8 at the end
    PV_SCALE: tl.constexpr = 256.0
    INV_PV_SCALE: tl.constexpr = 0.00390625
    # TMA path: columns of the scale words (fp32 view) and of the rope (bf16 view) in a token
    SC_COL: tl.constexpr = RANK // 4
    ROPE_COL: tl.constexpr = ROPE_OFF // 2

    b_first = tl.load(part_ptr + pid_p * 3 + 0)
    t_first = tl.load(part_ptr + pid_p * 3 + 1)
    j_first = tl.load(part_ptr + pid_p * 3 + 2)
    b_end = tl.load(part_ptr + (pid_p + 1) * 3 + 0)
    t_end = tl.load(part_ptr + (pid_p + 1) * 3 + 1)
    # the next part starting at tile 0 of b_end means this part stops before that request
    b_last = tl.where(t_end > 0, b_end, b_end - 1)
    ctx_w = tl.load(ctxw_ptr)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < ROWS
    tok = offs_m // H
    head = offs_m % H
    offs_r = tl.arange(0, RANK)
    offs_p = tl.arange(0, ROPE)
    offs_nb = tl.arange(0, BLOCK_N)
    # FP8 pointer path: tiles start at multiples of BLOCK_N within a request (planner), so when
    # BLOCK_N divides the page size a tile's keys are consecutive rows of one page -- one scalar
    # block-table load per tile and a loop-invariant per-key row offset instead of a page
    # lookup per key (H100: 1.01-1.035x for FP8 s_q=2, h=16 and h=128; 16-bit caches keep the
    # lookup, 0.97-1.01x there: h100-2026-11-26-kernel-tile-in-page-{before,after}.json)
    TILE_IN_PAGE: tl.constexpr = PAGE % BLOCK_N == 0
    row_offs = offs_nb * TOKEN_STRIDE
    offs_g = tl.arange(0, NG)
    offs_q = tl.arange(0, QW)
    ok_col = row_ok[:, None]
    m_rows = offs_m[:, None] * RANK
    if P_MEM:  # P through memory (module doc): this program's slot of the scratch buffers
        offs_ml = tl.arange(0, BLOCK_M)
        slot = tl.cast(pid_p * tl.num_programs(1) + pid_m, tl.int64)
        pscr_tile = pscr_ptr + slot * (BLOCK_M * BLOCK_N) + offs_ml[:, None] * BLOCK_N + offs_nb[None, :]
        ascr_rows = ascr_ptr + slot * BLOCK_M + offs_ml

    for b in range(b_first, b_last + 1):
        b64 = tl.cast(b, tl.int64)
        seq_len = tl.load(seq_ptr + b)
        n_tiles = (tl.maximum(seq_len, 0) + BLOCK_N - 1) // BLOCK_N
        t0 = tl.where(b == b_first, t_first, 0)
        t1 = tl.where(b == b_end, t_end, n_tiles)
        has_work = t1 > t0
        # nothing of request b in this part (an empty request, or a stale plan): it stores
        # nothing (the branches below). Under the interpreter its whole body is skipped too;
        # on the GPU that outer branch cost 5-10% at s_q=2 (module doc), so it is a
        # compile-time constant there and the body runs with no tile.
        if SKIP_EMPTY:
            run_body = has_work
        else:
            run_body = True
        if run_body:
            piece = tl.where(b == b_first, j_first, 0)
            nsplit = tl.load(nsplit_ptr + b)
            p_row = tl.load(off_ptr + b) + piece

            q_row = q_ptr + b64 * (ROWS * D) + offs_m * D
            q_rope = tl.load(q_row[:, None] + RANK + offs_p[None, :], mask=ok_col, other=0.0)
            if DOT_F32:
                q_rope = q_rope.to(tl.float32)
            if GROUPED:
                q0 = tl.load(q_row[:, None] + offs_q[None, :], mask=ok_col, other=0.0)
                q1 = tl.load(q_row[:, None] + QW + offs_q[None, :], mask=ok_col, other=0.0)
                q2 = tl.load(q_row[:, None] + 2 * QW + offs_q[None, :], mask=ok_col, other=0.0)
                q3 = tl.load(q_row[:, None] + 3 * QW + offs_q[None, :], mask=ok_col, other=0.0)
                if F16_DOTS:
                    # fp16 dots (module doc): each row times qs = 2**k, k <= 0, so that its
                    # max |q_lat| < 2**15, k from the exponent of the row max -- an integer max
                    # of the fp32 bits without the sign (NaN-proof: a NaN / inf row has exponent
                    # field 255 and gets k = -114, a zero or masked row 0 and k = 0)
                    q0 = q0.to(tl.float32)
                    q1 = q1.to(tl.float32)
                    q2 = q2.to(tl.float32)
                    q3 = q3.to(tl.float32)
                    top = tl.max(q0.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
                    top = tl.maximum(top, tl.max(q1.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1))
                    top = tl.maximum(top, tl.max(q2.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1))
                    top = tl.maximum(top, tl.max(q3.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1))
                    k_exp = tl.minimum(141 - (top >> 23), 0)  # min(0, 14 - E): 141 = 127 + 14
                    # 2**k and 2**-k built from their exponent fields (finite normals for every k)
                    qs = ((127 + k_exp) << 23).to(tl.float32, bitcast=True)[:, None]
                    lat_unscale = ((127 - k_exp) << 23).to(tl.float32, bitcast=True)[:, None]
                    q0 = (q0 * qs).to(tl.float16)
                    q1 = (q1 * qs).to(tl.float16)
                    q2 = (q2 * qs).to(tl.float16)
                    q3 = (q3 * qs).to(tl.float16)
                    if DOT_F32:  # the interpreter: the fp16 values, as fp32 dot operands
                        q0 = q0.to(tl.float32)
                        q1 = q1.to(tl.float32)
                        q2 = q2.to(tl.float32)
                        q3 = q3.to(tl.float32)
                elif DOT_F32:
                    q0 = q0.to(tl.float32)
                    q1 = q1.to(tl.float32)
                    q2 = q2.to(tl.float32)
                    q3 = q3.to(tl.float32)
                acc0 = tl.zeros([BLOCK_M, QW], dtype=tl.float32)
                acc1 = tl.zeros([BLOCK_M, QW], dtype=tl.float32)
                acc2 = tl.zeros([BLOCK_M, QW], dtype=tl.float32)
                acc3 = tl.zeros([BLOCK_M, QW], dtype=tl.float32)
            else:
                q_lat = tl.load(q_row[:, None] + offs_r[None, :], mask=ok_col, other=0.0)
                if DOT_F32:
                    q_lat = q_lat.to(tl.float32)
                acc = tl.zeros([BLOCK_M, RANK], dtype=tl.float32)
            # keys visible to each row's token: 0 for padding tokens (and tokens past the view)
            ctx = tl.load(ctx_ptr + b64 * ctx_w + tok, mask=row_ok & (tok < ctx_w), other=0)
            bt_row = bt_ptr + b64 * bt_stride

            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            if FP8:
                if FP8_PREFETCH:
                    # tile t0's bytes, carried into the loop (see FP8_PREFETCH in the module doc)
                    offs_n = t0 * BLOCK_N + offs_nb
                    kv_ok = (offs_n < seq_len) & ((offs_nb * 0 + t0) < t1)
                    pos_u = offs_n.to(tl.uint32)  # >= 0: unsigned // and % by the constant PAGE
                    page_id = tl.load(bt_row + pos_u // PAGE, mask=kv_ok, other=0)
                    cur_row = kv_ptr + (page_id.to(tl.int64) * PAGE + pos_u % PAGE) * TOKEN_STRIDE
                    rope_raw = tl.load((cur_row + ROPE_OFF).to(tl.pointer_type(tl.bfloat16))[:, None]
                                       + offs_p[None, :], mask=kv_ok[:, None], other=0.0)
                    if GROUPED:
                        pc0 = tl.load(cur_row[:, None] + offs_q[None, :], mask=kv_ok[:, None], other=0)
                        pc1 = tl.load(cur_row[:, None] + QW + offs_q[None, :], mask=kv_ok[:, None], other=0)
                        pc2 = tl.load(cur_row[:, None] + 2 * QW + offs_q[None, :], mask=kv_ok[:, None], other=0)
                        pc3 = tl.load(cur_row[:, None] + 3 * QW + offs_q[None, :], mask=kv_ok[:, None], other=0)
                        sc_row = (cur_row + RANK).to(tl.pointer_type(tl.float32))
                        ps0 = tl.load(sc_row, mask=kv_ok, other=0.0)
                        ps1 = tl.load(sc_row + G1, mask=kv_ok, other=0.0)
                        ps2 = tl.load(sc_row + G2, mask=kv_ok, other=0.0)
                        ps3 = tl.load(sc_row + G3, mask=kv_ok, other=0.0)
                    else:
                        codes = tl.load(cur_row[:, None] + offs_r[None, :], mask=kv_ok[:, None], other=0)
            for tile in range(t0, t1):
                offs_n = tile * BLOCK_N + offs_nb
                kv_ok = offs_n < seq_len
                # ---- this tile's keys (masked keys load as 0: codes, scales and rope)
                if FP8:
                    if USE_TMA:
                        # -- key positions -> cache rows: the tile is one box of rows of one page
                        #    (host: block_n | page_size). Its first key decides the page; the mask
                        #    only guards a stale plan (a tile past seq_len reads page 0, all masked).
                        n0 = tile * BLOCK_N
                        page_id = tl.load(bt_row + n0 // PAGE, mask=n0 < seq_len, other=0)
                        row0 = page_id * PAGE + n0 % PAGE
                        # The boxes hold every row of the tile, keys past seq_len too (the fuzzer
                        # poisons them with NaN): zero codes, scales and rope of those rows, as the
                        # pointer path's masked loads do (other=0), or 0 * NaN reaches P @ V.
                        k_rope = rope_desc.load([row0, ROPE_COL])
                        k_rope = tl.where(kv_ok[:, None], k_rope, tl.zeros_like(k_rope))
                        sc_all = scales_desc.load([row0, SC_COL])
                        sc_all = tl.where(kv_ok[:, None], sc_all, 0.0)
                        if GROUPED:
                            k0 = codes_desc.load([row0, 0])
                            k1 = codes_desc.load([row0, QW])
                            k2 = codes_desc.load([row0, 2 * QW])
                            k3 = codes_desc.load([row0, 3 * QW])
                            k0 = tl.where(kv_ok[:, None], k0, tl.zeros_like(k0))
                            k1 = tl.where(kv_ok[:, None], k1, tl.zeros_like(k1))
                            k2 = tl.where(kv_ok[:, None], k2, tl.zeros_like(k2))
                            k3 = tl.where(kv_ok[:, None], k3, tl.zeros_like(k3))
                            # quarter j's scale word: column Gj of the [BLOCK_N, NG] box (no slicing
                            # in Triton: a masked row sum over NG words)
                            sc0 = tl.sum(tl.where(offs_g[None, :] == 0, sc_all, 0.0), axis=1)
                            sc1 = tl.sum(tl.where(offs_g[None, :] == G1, sc_all, 0.0), axis=1)
                            sc2 = tl.sum(tl.where(offs_g[None, :] == G2, sc_all, 0.0), axis=1)
                            sc3 = tl.sum(tl.where(offs_g[None, :] == G3, sc_all, 0.0), axis=1)
                        else:
                            codes_now = codes_desc.load([row0, 0])
                            codes_now = tl.where(kv_ok[:, None], codes_now, tl.zeros_like(codes_now))
                    elif FP8_PREFETCH:
                        kv_row = cur_row
                        nxt_n = offs_n + BLOCK_N
                        nxt_ok = (nxt_n < seq_len) & ((offs_nb * 0 + tile + 1) < t1)
                        # -- key positions -> cache slots (the sparse-decode hook: read slots from
                        #    `indices` here and below instead of the block table)
                        pos_u = nxt_n.to(tl.uint32)  # >= 0: unsigned // and % by the constant PAGE
                        page_id = tl.load(bt_row + pos_u // PAGE, mask=nxt_ok, other=0)
                        cur_row = kv_ptr + (page_id.to(tl.int64) * PAGE + pos_u % PAGE) * TOKEN_STRIDE
                        k_rope = rope_raw
                        rope_raw = tl.load((cur_row + ROPE_OFF).to(tl.pointer_type(tl.bfloat16))[:, None]
                                           + offs_p[None, :], mask=nxt_ok[:, None], other=0.0)
                        if GROUPED:
                            k0 = pc0
                            k1 = pc1
                            k2 = pc2
                            k3 = pc3
                            sc0 = ps0
                            sc1 = ps1
                            sc2 = ps2
                            sc3 = ps3
                            pc0 = tl.load(cur_row[:, None] + offs_q[None, :], mask=nxt_ok[:, None], other=0)
                            pc1 = tl.load(cur_row[:, None] + QW + offs_q[None, :], mask=nxt_ok[:, None], other=0)
                            pc2 = tl.load(cur_row[:, None] + 2 * QW + offs_q[None, :], mask=nxt_ok[:, None], other=0)
                            pc3 = tl.load(cur_row[:, None] + 3 * QW + offs_q[None, :], mask=nxt_ok[:, None], other=0)
                            sc_row = (cur_row + RANK).to(tl.pointer_type(tl.float32))
                            ps0 = tl.load(sc_row, mask=nxt_ok, other=0.0)
                            ps1 = tl.load(sc_row + G1, mask=nxt_ok, other=0.0)
                            ps2 = tl.load(sc_row + G2, mask=nxt_ok, other=0.0)
                            ps3 = tl.load(sc_row + G3, mask=nxt_ok, other=0.0)
                        else:
                            codes_now = codes
                            codes = tl.load(cur_row[:, None] + offs_r[None, :], mask=nxt_ok[:, None], other=0)
                    else:
                        # -- key positions -> cache slots (the sparse-decode hook, as above)
                        if TILE_IN_PAGE:  # one page holds the tile: one block-table entry
                            n0 = tile * BLOCK_N
                            page0 = tl.load(bt_row + n0 // PAGE, mask=n0 < seq_len, other=0)
                            kv_row = kv_ptr + (page0.to(tl.int64) * PAGE + n0 % PAGE) * TOKEN_STRIDE + row_offs
                        else:
                            pos_u = offs_n.to(tl.uint32)  # >= 0: unsigned // and % by the constant PAGE
                            page_id = tl.load(bt_row + pos_u // PAGE, mask=kv_ok, other=0)
                            kv_row = kv_ptr + (page_id.to(tl.int64) * PAGE + pos_u % PAGE) * TOKEN_STRIDE
                        k_rope = tl.load((kv_row + ROPE_OFF).to(tl.pointer_type(tl.bfloat16))[:, None]
                                         + offs_p[None, :], mask=kv_ok[:, None], other=0.0)
                        if GROUPED:
                            k0 = tl.load(kv_row[:, None] + offs_q[None, :], mask=kv_ok[:, None], other=0,
                                         eviction_policy=K_EVICT)
                            k1 = tl.load(kv_row[:, None] + QW + offs_q[None, :], mask=kv_ok[:, None], other=0,
                                         eviction_policy=K_EVICT)
                            k2 = tl.load(kv_row[:, None] + 2 * QW + offs_q[None, :], mask=kv_ok[:, None], other=0,
                                         eviction_policy=K_EVICT)
                            k3 = tl.load(kv_row[:, None] + 3 * QW + offs_q[None, :], mask=kv_ok[:, None], other=0,
                                         eviction_policy=K_EVICT)
                            if TWIN:
                                # twin loads (module doc): the same bytes again for the PV dots; the
                                # other eviction hint keeps the compiler from merging the two loads
                                v0 = tl.load(kv_row[:, None] + offs_q[None, :], mask=kv_ok[:, None], other=0,
                                             eviction_policy="evict_first")
                                v1 = tl.load(kv_row[:, None] + QW + offs_q[None, :], mask=kv_ok[:, None], other=0,
                                             eviction_policy="evict_first")
                                v2 = tl.load(kv_row[:, None] + 2 * QW + offs_q[None, :], mask=kv_ok[:, None],
                                             other=0, eviction_policy="evict_first")
                                v3 = tl.load(kv_row[:, None] + 3 * QW + offs_q[None, :], mask=kv_ok[:, None],
                                             other=0, eviction_policy="evict_first")
                            sc_row = (kv_row + RANK).to(tl.pointer_type(tl.float32))
                            sc0 = tl.load(sc_row, mask=kv_ok, other=0.0)
                            sc1 = tl.load(sc_row + G1, mask=kv_ok, other=0.0)
                            sc2 = tl.load(sc_row + G2, mask=kv_ok, other=0.0)
                            sc3 = tl.load(sc_row + G3, mask=kv_ok, other=0.0)
                        else:
                            codes_now = tl.load(kv_row[:, None] + offs_r[None, :], mask=kv_ok[:, None], other=0)
                    if GROUPED:
                        # grouped dots: codes -> the latent q's dot dtype (exact: bf16, fp16 or
                        # fp32; fp16 with F16_DOTS), each quarter's scale on its dot result
                        k0 = k0.to(tl.float8e4nv, bitcast=True).to(q0.dtype)
                        k1 = k1.to(tl.float8e4nv, bitcast=True).to(q0.dtype)
                        k2 = k2.to(tl.float8e4nv, bitcast=True).to(q0.dtype)
                        k3 = k3.to(tl.float8e4nv, bitcast=True).to(q0.dtype)
                        if TWIN:
                            v0 = v0.to(tl.float8e4nv, bitcast=True).to(q0.dtype)
                            v1 = v1.to(tl.float8e4nv, bitcast=True).to(q0.dtype)
                            v2 = v2.to(tl.float8e4nv, bitcast=True).to(q0.dtype)
                            v3 = v3.to(tl.float8e4nv, bitcast=True).to(q0.dtype)
                        else:
                            v0 = k0
                            v1 = k1
                            v2 = k2
                            v3 = k3
                        s = tl.dot(q0, tl.trans(k0), input_precision=DOT_PREC) * sc0[None, :]
                        s += tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC) * sc1[None, :]
                        s += tl.dot(q2, tl.trans(k2), input_precision=DOT_PREC) * sc2[None, :]
                        s += tl.dot(q3, tl.trans(k3), input_precision=DOT_PREC) * sc3[None, :]
                        if F16_DOTS:
                            s = s * lat_unscale  # undo the rows' 2**k (exact), before the rope
                    else:
                        # dequantise: e4m3 value times its group's scale, broadcast through a
                        # [BLOCK_N, groups, group] view (a per-element gather of the scale words was
                        # measured 2-3x slower on an H200, benchmarks/results)
                        vals = codes_now.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                        if USE_TMA:
                            sc = sc_all
                        else:
                            scale_row = (kv_row + RANK).to(tl.pointer_type(tl.float32))
                            sc = tl.load(scale_row[:, None] + offs_g[None, :], mask=kv_ok[:, None], other=0.0)
                        k_lat = tl.reshape(tl.reshape(vals, (BLOCK_N, NG, GROUP)) * sc[:, :, None], (BLOCK_N, RANK))
                        k_lat = k_lat.to(q_lat.dtype)
                        if P_MEM:  # rope dot first: the latent dot's result then feeds no dot
                            s = tl.dot(q_rope, tl.trans(k_rope.to(q_rope.dtype)), input_precision=DOT_PREC)
                            s = tl.dot(q_lat, tl.trans(k_lat), s, input_precision=DOT_PREC)
                        else:
                            s = tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PREC)
                else:
                    # -- key positions -> cache slots (the sparse-decode hook: read slots from
                    #    `indices` here instead of the block table; the rest is slot-agnostic)
                    #    (a per-key lookup even when one page holds the tile: the FP8 path's
                    #    TILE_IN_PAGE shortcut measured 0.97-1.01x here on an H100)
                    pos_u = offs_n.to(tl.uint32)  # >= 0: unsigned // and % by the constant PAGE
                    page_id = tl.load(bt_row + pos_u // PAGE, mask=kv_ok, other=0)
                    kv_row = kv_ptr + (page_id.to(tl.int64) * PAGE + pos_u % PAGE) * TOKEN_STRIDE
                    # -- one latent KV row per key, shared by every query row of the program;
                    #    these loads feed the dots directly and Triton pipelines them (num_stages).
                    #    (Inlined rather than helpers: the interpreter re-patches triton.language
                    #    on every nested jit call, ~10 ms each.)
                    k_lat = tl.load(kv_row[:, None] + offs_r[None, :], mask=kv_ok[:, None], other=0.0)
                    k_rope = tl.load(kv_row[:, None] + RANK + offs_p[None, :], mask=kv_ok[:, None], other=0.0)
                    k_lat = k_lat.to(q_lat.dtype)
                    s = tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PREC)
                if not P_MEM:
                    k_rope = k_rope.to(q_rope.dtype)
                    s += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PREC)
                s = s * qk_scale
                visible = (offs_n[None, :] < ctx[:, None]) & kv_ok[None, :]
                # tl.where, not an additive bias: a NaN score (poisoned padding q) must vanish too
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_ref)
                p = tl.exp2(s - m_ref[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                if GROUPED:
                    # (P * sc_j) @ C_j, P * sc_j rounded to the codes' dot dtype (x 2**8, see
                    # PV_SCALE); with F16_DOTS to fp16 (under the interpreter: and back to fp32)
                    pw = p * (sc0 * PV_SCALE)[None, :]
                    if F16_DOTS:
                        pw = pw.to(tl.float16)
                    pv = tl.dot(pw.to(v0.dtype), v0, input_precision=DOT_PREC)
                    acc0 = acc0 * alpha[:, None] + pv
                    pw = p * (sc1 * PV_SCALE)[None, :]
                    if F16_DOTS:
                        pw = pw.to(tl.float16)
                    pv = tl.dot(pw.to(v1.dtype), v1, input_precision=DOT_PREC)
                    acc1 = acc1 * alpha[:, None] + pv
                    pw = p * (sc2 * PV_SCALE)[None, :]
                    if F16_DOTS:
                        pw = pw.to(tl.float16)
                    pv = tl.dot(pw.to(v2.dtype), v2, input_precision=DOT_PREC)
                    acc2 = acc2 * alpha[:, None] + pv
                    pw = p * (sc3 * PV_SCALE)[None, :]
                    if F16_DOTS:
                        pw = pw.to(tl.float16)
                    pv = tl.dot(pw.to(v3.dtype), v3, input_precision=DOT_PREC)
                    acc3 = acc3 * alpha[:, None] + pv
                else:
                    if P_MEM:
                        # P and alpha through this program's scratch slot (module doc, "P through
                        # memory"): nothing the PV dot reads derives from the QK dot's result, so
                        # Triton splits the QK tile's keys over the two warpgroups instead of
                        # computing it twice
                        tl.store(pscr_tile, p.to(k_lat.dtype))
                        tl.store(ascr_rows, alpha)
                        tl.debug_barrier()
                        p_op = tl.load(pscr_tile)
                        alpha_op = tl.load(ascr_rows)
                        tl.debug_barrier()  # every warp has read the slot before the next tile's store
                    else:
                        p_op = p.to(k_lat.dtype)
                        alpha_op = alpha
                    pv = tl.dot(p_op, k_lat, input_precision=DOT_PREC)
                    acc = acc * alpha_op[:, None] + pv
                m_i = m_new

            has_keys = l_i > 0.0
            l_safe = tl.where(has_keys, l_i, 1.0)
            lse2 = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
            l_col = l_safe[:, None]
            # one of two stores, on the request's uniform nsplit (module doc)
            if has_work & (nsplit == 1):
                # not split: the final out (q dtype, RNE) and the natural-log lse
                out_rows = out_ptr + b64 * (ROWS * RANK) + m_rows
                if GROUPED:
                    o = (acc0 * INV_PV_SCALE) / l_col
                    tl.store(out_rows + offs_q[None, :], to_out(o, out_ptr.dtype.element_ty), mask=ok_col)
                    o = (acc1 * INV_PV_SCALE) / l_col
                    tl.store(out_rows + QW + offs_q[None, :], to_out(o, out_ptr.dtype.element_ty), mask=ok_col)
                    o = (acc2 * INV_PV_SCALE) / l_col
                    tl.store(out_rows + 2 * QW + offs_q[None, :], to_out(o, out_ptr.dtype.element_ty), mask=ok_col)
                    o = (acc3 * INV_PV_SCALE) / l_col
                    tl.store(out_rows + 3 * QW + offs_q[None, :], to_out(o, out_ptr.dtype.element_ty), mask=ok_col)
                else:
                    o = acc / l_col
                    tl.store(out_rows + offs_r[None, :], to_out(o, out_ptr.dtype.element_ty), mask=ok_col)
                tl.store(lse_ptr + b64 * ROWS + head * SQ + tok, lse2 * LN2, mask=row_ok)
            elif has_work & (nsplit > 1) & (p_row < partial_cap):
                # split: this piece's fp32 partial (normalised output, base-2 lse) for combine
                p64 = p_row.to(tl.int64)
                po_rows = po_ptr + p64 * (ROWS * RANK) + m_rows
                if GROUPED:
                    tl.store(po_rows + offs_q[None, :], (acc0 * INV_PV_SCALE) / l_col, mask=ok_col)
                    tl.store(po_rows + QW + offs_q[None, :], (acc1 * INV_PV_SCALE) / l_col, mask=ok_col)
                    tl.store(po_rows + 2 * QW + offs_q[None, :], (acc2 * INV_PV_SCALE) / l_col, mask=ok_col)
                    tl.store(po_rows + 3 * QW + offs_q[None, :], (acc3 * INV_PV_SCALE) / l_col, mask=ok_col)
                else:
                    tl.store(po_rows + offs_r[None, :], acc / l_col, mask=ok_col)
                tl.store(plse_ptr + p64 * ROWS + offs_m, lse2, mask=row_ok)


def launch_decode_split(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits,
                        split_offsets, out, lse, partial_o, partial_lse, *, softmax_scale: float, rank: int,
                        rope_dim: int, fp8_group: int, block_m: int, block_n: int, num_warps: int,
                        num_stages: int, dot_f32: bool, fp8_prefetch: bool = True, fp8_grouped: bool = True) -> None:
    """Launch the decode (arguments checked by ``ops.decode_split``).

    Shapes: q ``[B, s_q, h, rank + rope]``; block_table int32 ``[B, max_blocks]``;
    cache_seqlens int32 ``[B]``; ctx_lens int32 ``[B, W]`` with ``W = ctx_width[0]``;
    part_info int32 ``[num_parts + 1, 3]``; num_splits / split_offsets int32 ``[B]``;
    out ``[B, s_q, h, rank]``; lse fp32 ``[B, h, s_q]``; partial_o fp32 ``[cap, s_q*h, rank]``;
    partial_lse fp32 ``[cap, s_q*h]``. FP8 caches take the grouped-dot path where
    ``fp8_grouped`` (``DecodeConfig.fp8_grouped``) and ``fp8_grouped_dots(rank, fp8_group, block_m)``
    (module doc), else the dequantise path;
    ``fp8_prefetch`` applies to both and is ignored for 16-bit caches.
    On the grouped path with bf16 queries, ``FP8_FP16_DOTS`` (read here at every launch)
    feeds the latent dots fp16 operands — codes, q scaled per row by a power of two, and
    ``P * sc`` — instead of bf16 ones (module doc, "FP16 dots"); with ``dot_f32`` (the
    interpreter) the same roundings are applied and the dots run in fp32.
    Where ``fp8_tma_plan`` allows it, FP8 tiles come through TMA descriptors made here from
    ``kv_cache`` (module doc, "TMA path"); ``fp8_prefetch`` and twin loads are then off and
    the kernel is compiled with the plan's ``num_stages``.
    Where ``fp8_p_via_memory`` holds (FP8, dequantise path, ``block_m >= 64``), the launcher
    allocates the kernel's scratch slots (``[programs, block_m, block_n]`` in the dot dtype for
    P, ``[programs, block_m]`` fp32 for alpha; module doc, "P through memory").
    """
    B, s_q, h, _ = q.shape
    num_parts = part_info.shape[0] - 1
    m_blocks = triton.cdiv(s_q * h, block_m)
    fp8 = kv_cache.dtype == torch.uint8
    if not dot_f32 and wgmma_plan(q, kv_cache, rank=rank, rope_dim=rope_dim, block_m=block_m, block_n=block_n,
                                  num_warps=num_warps, fp8_group=fp8_group) is None:
        # Hopper: a Gluon kernel -- 64-row blocks the ping-pong one of kernels/decode_wgmma_pp.py
        # (16-bit, two or more row blocks; else, or with its switch off, the one of
        # decode_wgmma.py), FP8 ones the
        # warp-specialised decode_wgmma_ws64.py; few-row blocks of 4 warps of a 16-bit cache the
        # TMA keys-on-M decode_wgmma_kt.py (wgmma_plan checked kt_plan), of an FP8 one the
        # register-operand decode_wgmma_rs.py where its TMA copies apply (rs_plan; wgmma_plan
        # admits more rows than one block only then), else the warp-specialised
        # decode_wgmma_ws.py, of 8 warps the keys-on-M decode_wgmma_keys.py. A
        # build failure (compile or resources: raised before anything is launched) sends this
        # and every later launch to this kernel, with a warning
        try:
            if block_m == 64:
                launch = (launch_decode_wgmma_ws64 if ws64_taken(kv_cache) else
                          launch_decode_wgmma_pp if pp_taken(q, kv_cache) else launch_decode_wgmma)
            else:
                launch = (launch_decode_wgmma_keys if num_warps != 4 else
                          launch_decode_wgmma_kt if not fp8 else
                          launch_decode_wgmma_rs if rs_plan(kv_cache, block_n) is None else launch_decode_wgmma_ws)
            launch(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits,
                   split_offsets, out, lse, partial_o, partial_lse, softmax_scale_log2=float(softmax_scale) * _LOG2E,
                   rank=rank, rope_dim=rope_dim, fp8_group=fp8_group, block_m=block_m, block_n=block_n)
            return
        except TritonError as e:
            mark_unavailable(e)
    grouped = fp8 and bool(fp8_grouped) and fp8_grouped_dots(rank, fp8_group, block_m)
    tma = fp8_tma_plan(kv_cache, rank=rank, rope_dim=rope_dim, fp8_group=fp8_group, block_m=block_m,
                       block_n=block_n, num_stages=num_stages) if fp8 else None
    use_tma = tma is not None and tma.use
    if use_tma:
        descs = _fp8_tma_descriptors(kv_cache, rank=rank, rope_dim=rope_dim, fp8_group=fp8_group,
                                     block_n=block_n, grouped=grouped)
        num_stages = tma.num_stages
    else:
        descs = (kv_cache, kv_cache, kv_cache)  # placeholders: the pointer path never reads them
    prefetch = bool(fp8_prefetch) and fp8 and not use_tma
    f16_dots = grouped and q.dtype == torch.bfloat16 and bool(FP8_FP16_DOTS)
    twin = grouped and not prefetch and not use_tma and num_stages >= 2 and block_m <= 32 and bool(FP8_TWIN_LOADS)
    page = kv_cache.shape[1]
    pdl = pdl_on(q)
    grid = (num_parts, m_blocks)
    p_mem = fp8_p_via_memory(fp8, grouped, block_m)
    if p_mem:
        # one slot per program, never read across launches (written before read in every
        # tile), so a fresh buffer per launch is safe under graph capture too; P in the dot
        # operand dtype (fp32 with dot_f32)
        p_dtype = torch.float32 if dot_f32 else q.dtype
        pscr = torch.empty(num_parts * m_blocks * block_m * block_n, dtype=p_dtype, device=q.device)
        ascr = torch.empty(num_parts * m_blocks * block_m, dtype=torch.float32, device=q.device)
    else:
        pscr = ascr = lse  # placeholders: never read
    _decode_split_kernel[grid](
        q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits, split_offsets,
        out, lse, partial_o, partial_lse, *descs, pscr, ascr,
        block_table.shape[1], partial_o.shape[0], float(softmax_scale) * _LOG2E, s_q, h, PAGE=page,
        RANK=rank, ROPE=rope_dim, GROUP=fp8_group, TOKEN_STRIDE=kv_cache.shape[-1],
        FP8=fp8, BLOCK_M=block_m, BLOCK_N=block_n, DOT_F32=dot_f32,
        # None: Triton's default precision (only fp32 operands care, and those come with DOT_F32)
        DOT_PREC="ieee" if dot_f32 else None,
        FP8_PREFETCH=prefetch, GROUPED=grouped, TWIN=twin, K_EVICT="evict_last" if twin else "",
        USE_TMA=use_tma, F16_DOTS=f16_dots, SKIP_EMPTY=bool(SKIP_EMPTY_ON_INTERPRETER) and interpreting(),
        P_MEM=p_mem, PDL=pdl, num_warps=num_warps, num_stages=num_stages, **launch_options(pdl))
