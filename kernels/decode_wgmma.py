"""Hopper split-KV decode at 64-row blocks, written in Gluon (GPU only): 16-bit and FP8 caches.

The same contract, plan and stores as ``decode_split._decode_split_kernel`` (grid
``(num_parts, m_blocks)``, one program per (part, row block); parts from the planner; a
request that is not split stores ``out``/``lse``, a split one its fp32 partial), for the
shape where that kernel is bound by its serial wgmma chain: 64 query rows a block (h=128;
and h=16 with its 16 or 32 rows padded to 64, below). Triton's ``tl.dot`` there computes
the ``Q K^T`` tile in *both* warpgroups (a dot whose result reaches another dot gets every
warp along M) and waits for each dot before the next step. Gluon states the layouts, the
shared buffers and the waits, so here:

- both dots are laid out ``[4, 2]``: for ``S = Q K^T`` (64 rows x 64 keys) each warpgroup
  computes 32 keys; for ``acc += P V`` (64 rows x 512 latent columns) each computes 256
  columns. Each warpgroup's half of P goes to a shared ``[64, 64]`` buffer; after a barrier
  the PV dot reads all of it. The row max and sum of the softmax span both warpgroups
  (Gluon's cross-warp reduction).
- the key tiles are copied ``cp.async`` into a ring of two shared buffers (one tile in
  flight while one is used), a key's row found through the block table as in the Triton
  kernel; keys past ``seq_len`` are masked copies, which land as zeros (a NaN-poisoned stale
  slot never reaches ``P @ V``).
- the PV dot is issued asynchronously and waited for only at the top of the next tile,
  after the next copy has been issued.

Per tile (``S`` scaled by ``softmax_scale * log2(e)``)::

    S   = where(visible, Q_lat K_lat^T + Q_rope K_rope^T, -inf)
    m'  = max(m, rowmax S);  P = exp2(S - m');  alpha = exp2(m - m')
    l   = l alpha + rowsum P;  acc = acc alpha + P K_lat;  m = m'

FP8 caches: the ring holds the tile's e4m3 codes, fp32 scales and bf16 rope as copied; the
warps dequantise the codes into one shared bf16 K tile, a scale group (128 columns) at a
time, ``code * scale`` in fp32 rounded to bf16 -- the values the Triton kernel's dequantise
path feeds its dots -- and the dots read that tile and the copied rope. One K tile, not two:
two do not fit next to the codes' ring, so the dequantisation of tile i+1 waits for the PV
dot of tile i. FP8 takes bf16 queries only (the cache's rope is bf16 and meets q's rope in
a dot as it is); fp16 queries stay on the Triton kernel.

Shared memory at rank 512 + rope 64 and 64-key tiles: q 72 KiB, P 8 KiB, and two 72 KiB
tiles (16-bit: 224.5 KiB in all) or two 41 KiB FP8 tiles and one 64 KiB K tile (226.5 KiB),
of the H100's 227.

Measured on an H100 against the Triton kernel's defaults, same command, best of two runs
each (``benchmarks/results/h100-2026-11-26-wgmma-ab-bf16.json`` / ``-wgmma-ab-fp8.json``; B
1-128, L 1k-16k): bf16 h=128 1.17-1.47x (s_q=1) and 1.14-1.42x (s_q=2); FP8 (parts of two
tiles) 1.05-1.14x at h=128, s_q=1, 0.99-1.11x at h=128, s_q=2 and 1.05-1.23x at h=16, s_q=2 --
FP8 is held back by its dequantisation, which does not overlap the dots.

Tried and not kept: FP8 with the scales on the dot results (the Triton kernel's grouped
path: codes converted to fp16 exactly, q's latent to fp16 scaled per row by a power of two,
four group dots whose scores are scaled per key in fp32, ``P * scale`` per group into four
shared P buffers, one staging buffer so that it fits): correct, but 0.88-1.00x the
dequantising kernel (``h100-2026-11-26-wgmma-fp8-grouped.json``) -- the cheaper conversion
did not pay for the serial group dots and the tile copy it exposes. Looking the next tile's
pages up in the block table a tile ahead of its copies: level (0.97-1.04x); bf16 parts of
one tile instead of two: 0.80-1.04x (``h100-2026-11-26-wgmma-pages-ahead.json``). Issuing a
tile's QK before waiting for the previous PV (and the next tile's copies after that wait):
0.88-0.98x (``h100-2026-11-26-wgmma-early-qk.json``). FP8 with the codes and scales of the
next tile loaded into registers a tile ahead and dequantised into a second K tile while the PV
dot runs (so two K tiles fit, no staging): correct, but 744 bytes of spilled registers a
thread and 1.75-4.2x slower (``h100-2026-11-26-wgmma-fp8-reg-prefetch.json``). FP8 at 32-key
tiles, where two dequantised K tiles fit (the next one dequantised while the PV dot runs):
correct, but 0.78-0.95x (``h100-2026-11-26-wgmma-fp8-two-k-tiles.json``) -- the halved
score tiles (16 keys a warpgroup) cost more than the overlap saves.

What bounds it now (H100, bf16, h=128, s_q=2, B=128, L=16k: about 5400 cycles a 64-key tile
against 2200 of tensor-core work): every step of a tile waits for the one before -- PV,
copies, QK, softmax with its two cross-warpgroup reductions, rescale, P through shared
memory -- and the tensor cores idle outside the two dots. Overlapping the softmax of one
tile with the QK of the next needs a third tile buffer or the two warpgroups working on
alternate tiles (FlashMLA's "seesaw"); the 72 KiB q block leaves no room for the first, and
the second needs warp-specialised partitions.

A tile's page is loaded a tile ahead of its copies when a page holds whole tiles (pages of
64+ keys, ``gluon_parts.tile_page``): level on this kernel's launches (bf16 h=16 x 2:
0.98-1.04x, ``h100-2026-11-26-kernel-18*.json``), kept for the shared copy code.

Taken by ``decode_split.launch_decode_split`` when ``wgmma_plan`` says so (CUDA device of
compute capability 9.x, ``block_m == 64``, ``block_n == 64``, 8 warps, rank 512 + rope 64,
a bf16/fp16 cache with q of its dtype or an FP8 cache of 128-value groups with bf16 q, the
``WGMMA_DECODE`` switch on) -- except FP8 launches while ``WGMMA_WS64`` is on, which the
warp-specialised ``kernels/decode_wgmma_ws64.py`` runs instead (its producer partition
dequantises the next tile while the dots run: 1.06-1.30x this kernel's FP8 at h=128), and
16-bit launches of two or more row blocks and 16+ (request, row block) pairs while
``WGMMA_PP`` is on, which the ping-pong ``kernels/decode_wgmma_pp.py`` runs (its two
warpgroups on alternate tiles: 0.94-1.42x this kernel at h=128, ``pp_taken``); on such a
device ``config.default_config`` gives it h=128 (bf16,
fp16, FP8: 64-key tiles; the part sizes are in that function), and h=16 bf16 at s_q=2 (32 query
rows in a 64-row block, the rest masked padding) with ``WGMMA_KT`` off. h=16 FP8 takes a
few-row kernel instead, which ``wgmma_plan`` admits too: at s_q=1 (16 rows) the register-operand one of
``kernels/decode_wgmma_rs.py`` where its TMA copies apply (switch ``WGMMA_RS``, ``rs_plan``),
else the warp-specialised one of ``kernels/decode_wgmma_ws.py`` (switch ``WGMMA_WS``, which
turns both off), at s_q=2 -- and at s_q=1 with that switch
off -- the keys-on-M one of ``kernels/decode_wgmma_keys.py`` (this kernel ran both before, padded
to 64 rows, and still does with ``WGMMA_KEYS`` off). h=16 bf16 / fp16 at s_q=1 takes the TMA
keys-on-M kernel of ``kernels/decode_wgmma_kt.py`` where its copies apply (switch ``WGMMA_KT``,
``kt_plan``; else, and with the switch off, the Triton kernel), and at s_q=2 too (32-row blocks;
with the switch off, this kernel). It is
written against Triton 3.6's Gluon, an experimental API: if it fails to build with the
installed Triton (a compile or resource error, raised before anything is launched), the
first launch warns and it and every later one take the Triton kernel (``mark_unavailable``).
Gluon has no interpreter, so the CPU suite runs the Triton kernel (and checks the choice);
the ``gpu`` tests run this one against ``mla_ref``, inside CUDA graphs too.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma_init,
                                                                  warpgroup_mma_wait)
except Exception:  # pragma: no cover - a Triton without Gluon: the Triton kernel only
    gluon = None

from .decode_wgmma_keys import KEYS_BLOCK_N
from .decode_wgmma_kt import kt_descriptors_available
from .decode_wgmma_rs import rs_descriptors_available
from .decode_wgmma_ws import WS_BLOCK_N, WS_WARPS
from .gluon_parts import (copy_q_rows, key_rows, program_rows, request_span, row_copy_layout, rows_tile_step,
                          store_rows_result, tile_page, wait_prior_grid, wgmma_layout)
from .pdl import pdl_on

__all__ = ["WGMMA_DECODE", "WGMMA_KEYS", "WGMMA_WS", "WGMMA_RS", "WGMMA_KT", "WGMMA_WS64", "WGMMA_PP", "wgmma_plan",
           "rs_plan", "kt_plan", "ws64_taken", "pp_taken", "launch_decode_wgmma", "mark_unavailable"]

#: Take this kernel where ``wgmma_plan`` allows it. A module switch (benchmarks A/B it;
#: tests turn it off to time / check the Triton kernel on the same GPU).
WGMMA_DECODE = True
#: Take the few-row FP8 kernel (``decode_wgmma_keys``) for 16/32-row blocks of 128-key
#: tiles (a switch like ``WGMMA_DECODE``, which also turns it off; ``config.default_config``
#: gives those blocks only while it is on).
WGMMA_KEYS = True
#: Take the warp-specialised FP8 kernel (``decode_wgmma_ws``) for 16-row blocks of 64-key
#: tiles with 4 warps (a switch like ``WGMMA_KEYS``; ``WGMMA_DECODE`` turns it off too).
WGMMA_WS = True
#: Take the register-operand FP8 kernel (``decode_wgmma_rs``: TMA copies of the raw cache rows,
#: the codes converted in two consumer warpgroups' registers) for the launches of that shape,
#: where its copies apply (``rs_plan``; a switch like ``WGMMA_WS``; off, ``decode_wgmma_ws`` runs
#: them).
WGMMA_RS = True
#: Take the TMA keys-on-M kernel (``decode_wgmma_kt``) for 16-bit caches in 16- or 32-row blocks
#: of 64-key tiles with 4 warps, where its copies apply (``kt_plan``; a switch like ``WGMMA_RS``;
#: off, ``config.default_config`` gives those launches their former blocks again: the Triton
#: kernel's at 16 rows, this module's 64-row ones at 32).
WGMMA_KT = True
#: Take the warp-specialised 64-row FP8 kernel (``decode_wgmma_ws64``: a producer partition
#: dequantises the next tile while the dots run) for the FP8 64-row blocks this module's kernel
#: would otherwise run (a switch like ``WGMMA_WS``; off, this module's kernel runs them).
WGMMA_WS64 = True
#: Take the ping-pong 64-row kernel (``decode_wgmma_pp``: the two warpgroups on alternate tiles,
#: each its own partition) for the 16-bit 64-row blocks this module's kernel would otherwise run
#: (a switch like ``WGMMA_WS64``; off, this module's kernel runs them).
WGMMA_PP = True
#: Why this kernel cannot be built in this process (None: it can, as far as is known). Set
#: by ``mark_unavailable`` when the first build fails -- a Triton whose Gluon differs from the
#: one the kernel is written for (3.6) -- so that every later launch takes the Triton kernel.
UNAVAILABLE: Optional[str] = None
#: The FP8 scale group the dequantisation is written for (a warp converts 4 rows x 128 codes
#: per step, one group's worth of a key; DeepSeek's 128).
FP8_GROUP = 128


def wgmma_plan(q: torch.Tensor, kv_cache: torch.Tensor, *, rank: int, rope_dim: int, block_m: int, block_n: int,
               num_warps: int, fp8_group: int = 128, capability: Optional[tuple] = None) -> Optional[str]:
    """None when a Gluon kernel can run the launch, else the reason none can (host-side,
    static: a captured graph's kernel choice depends only on capture-time facts). Three shapes
    are taken: 64-row blocks of 64-key tiles with 8 warps (this module's kernel; 16-bit or FP8
    caches); 16- or 32-row blocks of 128-key tiles with 8 warps holding all ``s_q * h`` query
    rows (FP8 only: ``decode_wgmma_keys``, switch ``WGMMA_KEYS``); 16-row blocks of 64-key tiles
    with 4 warps (FP8: the warp-specialised ``decode_wgmma_ws``, switch ``WGMMA_WS``, or where
    ``rs_plan`` admits the cache the register-operand ``decode_wgmma_rs``, the only one of the two
    that takes more rows than one block; 16-bit, also 32-row blocks: the TMA ``decode_wgmma_kt``
    where ``kt_plan`` admits the cache, in as many blocks as the rows need).

    q ``[B, s_q, h, rank + rope]`` (bf16 / fp16 take it); kv_cache ``[num_blocks, page,
    rank + rope]`` of q's dtype, or uint8 ``[num_blocks, page, rank + 4 * groups + 2 * rope]``
    FP8 tokens (codes, fp32 scales, bf16 rope) with bf16 q. Only dtypes, the last dim and the
    device are read.

    ``capability``: the device's compute capability; None reads it from ``q``'s device (and
    a CPU tensor cannot take the kernel). Passing it lets tests ask what a device would get.
    """
    if gluon is None:
        return "this Triton has no Gluon"
    if not WGMMA_DECODE:
        return "WGMMA_DECODE is off"
    if UNAVAILABLE is not None:
        return f"the Gluon kernel failed to build in this process: {UNAVAILABLE}"
    if capability is None:
        if q.device.type != "cuda":
            return "not a CUDA tensor"
        capability = tuple(torch.cuda.get_device_capability(q.device))
    cap = tuple(capability)
    if cap[0] != 9:
        return f"compute capability {cap} is not Hopper (9.x)"
    if kv_cache.dtype == torch.uint8:
        if q.dtype != torch.bfloat16:
            # the cache's rope is bf16 and feeds a dot with q's rope as it is
            return f"FP8 cache with {q.dtype} queries (this kernel takes bf16 queries)"
        if fp8_group != FP8_GROUP:
            return f"FP8 scale group of {fp8_group} (this kernel dequantises groups of {FP8_GROUP})"
        if kv_cache.shape[-1] != rank + 4 * (rank // fp8_group) + 2 * rope_dim:
            return "FP8 token layout is not codes + fp32 scales + bf16 rope"
    elif kv_cache.dtype not in (torch.bfloat16, torch.float16) or q.dtype != kv_cache.dtype:
        return "not a 16-bit or FP8 cache with q of the cache's dtype"
    if (rank, rope_dim) != (512, 64):
        return f"rank {rank} + rope {rope_dim} (the shared-memory budget is sized for 512 + 64)"
    if (block_m, block_n, num_warps) == (64, 64, 8):
        return None
    if block_m in (16, 32) and (block_n, num_warps) == (WS_BLOCK_N, WS_WARPS) and kv_cache.dtype != torch.uint8:
        # a 16-bit cache: the TMA keys-on-M kernel (kernels/decode_wgmma_kt.py), one program a
        # part and row block
        return kt_plan(kv_cache, block_n)
    if (block_m, block_n, num_warps) == (16, WS_BLOCK_N, WS_WARPS):
        # the few-row FP8 kernels: the register-operand one (kernels/decode_wgmma_rs.py) where
        # its TMA copies apply, in as many row blocks as the rows need; else the
        # warp-specialised one (kernels/decode_wgmma_ws.py), whose rows fit one block
        reason = _few_row_reason(q, kv_cache, block_m, block_n, "WGMMA_WS", WGMMA_WS, "warp-specialised",
                                 one_block=False)
        if reason is None and q.shape[1] * q.shape[2] > block_m:
            rs = rs_plan(kv_cache, block_n)
            if rs is not None:
                return (f"{q.shape[1] * q.shape[2]} query rows in {block_m}-row blocks (only the TMA kernel takes "
                        f"several, and it cannot run: {rs})")
        return reason
    if block_n == KEYS_BLOCK_N and block_m in (16, 32) and num_warps == 8:
        # the few-row FP8 kernel, keys on the wgmma M axis (kernels/decode_wgmma_keys.py)
        return _few_row_reason(q, kv_cache, block_m, block_n, "WGMMA_KEYS", WGMMA_KEYS, "keys-on-M")
    return (f"block {block_m}x{block_n} with {num_warps} warps (these kernels are 64x64, or for FP8 16/32 rows "
            f"x {KEYS_BLOCK_N} keys with 8 warps, 16 rows x {WS_BLOCK_N} keys with {WS_WARPS}, for 16-bit caches "
            f"16/32 rows x {WS_BLOCK_N} keys with {WS_WARPS})")


def ws64_taken(kv_cache: torch.Tensor) -> bool:
    """Whether a 64-row launch that ``wgmma_plan`` admitted runs the warp-specialised FP8 kernel
    of ``decode_wgmma_ws64`` (an FP8 cache: uint8 ``[num_blocks, page, token bytes]``, and the
    ``WGMMA_WS64`` switch on) rather than this module's."""
    return kv_cache.dtype == torch.uint8 and bool(WGMMA_WS64)


def rs_plan(kv_cache: torch.Tensor, block_n: int) -> Optional[str]:
    """None when a launch that ``wgmma_plan`` admitted for the warp-specialised few-row FP8 kernel
    (16-row blocks of ``block_n``-key tiles, 4 warps) runs ``decode_wgmma_rs`` instead, else the
    reason it keeps ``decode_wgmma_ws`` (static, capture-time facts only). kv_cache: uint8
    ``[num_blocks, page, token bytes]``.

    ``decode_wgmma_rs`` copies each tile with TMA, one box of ``min(page, block_n)`` rows a page,
    into 128-byte-swizzled shared memory: the cache must be contiguous with a 16-byte aligned
    base and 16-byte rows, a page must hold whole tiles or a tile whole pages, a box must be a
    multiple of the swizzle's 8 rows, and TMA's row coordinate is an int32."""
    if not WGMMA_RS:
        return "WGMMA_RS is off"
    if not rs_descriptors_available():
        return "this Triton's Gluon has no TMA tensor descriptor"
    if kv_cache.dim() != 3 or not kv_cache.is_contiguous():
        return "cache not a contiguous [num_blocks, page_size, bytes_per_token] tensor"
    return _tma_rows_reason(kv_cache, kv_cache.shape[-1], block_n)


def _tma_rows_reason(kv_cache: torch.Tensor, token_bytes: int, block_n: int) -> Optional[str]:
    """What keeps TMA from copying ``block_n``-key tiles of a contiguous cache (``[num_blocks,
    page, ...]``, ``token_bytes`` a key) in boxes of ``min(page, block_n)`` rows a page into
    128-byte-swizzled shared memory (``rs_plan``, ``kt_plan``): a base not 16-byte aligned, rows
    not a multiple of 16 bytes, pages that neither hold whole tiles nor fit whole in one, boxes
    not a multiple of the swizzle's 8 rows, more rows than an int32 coordinate. None: nothing."""
    nb, page = kv_cache.shape[0], kv_cache.shape[1]
    if kv_cache.data_ptr() % 16:
        return "cache base not 16-byte aligned (TMA)"
    if token_bytes % 16:
        return f"{token_bytes} bytes per token: TMA rows need a multiple of 16"
    if page % block_n and block_n % page:
        return f"page size {page} neither a multiple nor a divisor of the {block_n}-key tile"
    if min(page, block_n) % 8:
        return f"TMA boxes of {min(page, block_n)} rows (the 128-byte swizzle takes multiples of 8)"
    if nb * page >= 2 ** 31:
        return "more than 2**31 cache rows (TMA coordinates are int32)"
    return None


def kt_plan(kv_cache: torch.Tensor, block_n: int) -> Optional[str]:
    """None when a 16-bit launch of ``wgmma_plan``'s few-row shape (16- or 32-row blocks of
    ``block_n``-key tiles, 4 warps) can run ``decode_wgmma_kt``, else the reason it cannot
    (static, capture-time facts only; the launch then takes the Triton kernel). kv_cache: bf16 /
    fp16 ``[num_blocks, page, 1, d_qk]``.

    ``decode_wgmma_kt`` copies each tile with TMA, boxes of ``min(page, block_n)`` rows a page
    and 64 columns, into 128-byte-swizzled shared memory: the cache must be contiguous with a
    16-byte aligned base and 16-byte rows, a page must hold whole tiles or a tile whole pages, a
    box must be a multiple of the swizzle's 8 rows, and TMA's row coordinate is an int32."""
    if not WGMMA_KT:
        return "WGMMA_KT is off"
    if not kt_descriptors_available():
        return "this Triton's Gluon has no TMA tensor descriptor"
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1 or not kv_cache.is_contiguous():
        return "cache not a contiguous [num_blocks, page_size, 1, d_qk] tensor"
    return _tma_rows_reason(kv_cache, kv_cache.shape[-1] * kv_cache.element_size(), block_n)


def pp_taken(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether a 64-row launch that ``wgmma_plan`` admitted runs the ping-pong kernel of
    ``decode_wgmma_pp`` rather than this module's (q ``[B, s_q, h, d]``, static facts only: the
    choice is baked into a captured graph): a 16-bit cache ``[num_blocks, page, rank + rope]``,
    more than one 64-row block of query rows (``m = ceil(s_q * h / 64) >= 2``), at least 16
    (request, row block) pairs (``B * m >= 16``), and the ``WGMMA_PP`` switch on.

    Why (H100, ``benchmarks/results/h100-2026-11-26-wgmma-pp-ab.json``): with one row block
    every key tile is read by one program only and the decode is bound by its copies, which
    the ping-pong kernel's one tile a warpgroup exposes (0.81-0.97x this kernel at h=16 x 2
    and h=64, B 8-128); and at B=1 (2-4 programs of one or two tiles' pairs) its hand-overs
    cost more than they overlap (0.88-0.97x, ``-kernel-17.json``)."""
    m_blocks = -(-(q.shape[1] * q.shape[2]) // 64)
    return (kv_cache.dtype in (torch.bfloat16, torch.float16) and m_blocks >= 2 and q.shape[0] * m_blocks >= 16
            and bool(WGMMA_PP))


def _few_row_reason(q: torch.Tensor, kv_cache: torch.Tensor, block_m: int, block_n: int, switch: str, on: bool,
                    kernel: str, *, one_block: bool = True) -> Optional[str]:
    """``wgmma_plan``'s checks for a few-row FP8 kernel (the shape already matched): its
    switch ``switch`` (value ``on``), an FP8 cache, and (``one_block``) every query row of a
    request in the one ``block_m``-row block. None, or the reason naming ``kernel``."""
    if not on:
        return f"{switch} is off"
    if kv_cache.dtype != torch.uint8:
        return f"block {block_m}x{block_n}: the {kernel} kernel takes FP8 caches only"
    if one_block and q.shape[1] * q.shape[2] > block_m:
        return f"{q.shape[1] * q.shape[2]} query rows in a {block_m}-row block (the {kernel} kernel takes one block)"
    return None


if gluon is not None:

    @gluon.jit
    def _issue_tile(k_lat_buf, k_rope_buf, sc_buf, kv_ptr, bt_row, tile, seq_len, page0, PAGE: gl.constexpr,
                    RANK: gl.constexpr, ROPE: gl.constexpr, NG: gl.constexpr, TOKEN_STRIDE: gl.constexpr,
                    BLOCK_N: gl.constexpr, FP8: gl.constexpr, LAT_L: gl.constexpr, ROPE_L: gl.constexpr,
                    SC_L: gl.constexpr):
        # Copy one tile's keys into shared memory (cp.async). Keys past seq_len (and a whole
        # tile past the request, issued to keep the group count uniform) are masked: cp.async
        # writes zeros for them, so a NaN-poisoned stale slot never reaches a dot.
        # A 16-bit cache: the latent and the rope of each key. FP8: the e4m3 codes, the fp32
        # group scales and the bf16 rope (token layout codes | scales | rope). The keys' rows:
        # in page ``page0`` (``tile_page``, loaded a tile ahead) when a page holds whole tiles.
        offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAT_L))
        kv_ok = offs_n < seq_len
        row = key_rows(kv_ptr, bt_row, offs_n, kv_ok, page0, PAGE, BLOCK_N, TOKEN_STRIDE)
        cols = gl.arange(0, RANK, layout=gl.SliceLayout(0, LAT_L))
        async_copy.async_copy_global_to_shared(k_lat_buf, row[:, None] + cols[None, :],
                                               mask=kv_ok[:, None] & (cols[None, :] < RANK))
        offs_nr = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ROPE_L))
        ok_r = offs_nr < seq_len
        row_r = key_rows(kv_ptr, bt_row, offs_nr, ok_r, page0, PAGE, BLOCK_N, TOKEN_STRIDE)
        cols_r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, ROPE_L))
        if FP8:
            rope_ptr = (row_r + RANK + 4 * NG).to(gl.pointer_type(k_rope_buf.dtype))
        else:
            rope_ptr = row_r + RANK
        async_copy.async_copy_global_to_shared(k_rope_buf, rope_ptr[:, None] + cols_r[None, :],
                                               mask=ok_r[:, None] & (cols_r[None, :] < ROPE))
        if FP8:
            offs_ns = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SC_L))
            ok_s = offs_ns < seq_len
            sc_at = key_rows(kv_ptr, bt_row, offs_ns, ok_s, page0, PAGE, BLOCK_N, TOKEN_STRIDE) + RANK
            cols_s = gl.arange(0, NG, layout=gl.SliceLayout(0, SC_L))
            async_copy.async_copy_global_to_shared(sc_buf, sc_at.to(gl.pointer_type(gl.float32))[:, None]
                                                   + cols_s[None, :], mask=ok_s[:, None] & (cols_s[None, :] < NG))

    @gluon.jit
    def _dequantise(codes_buf, sc_buf, k_lat_s, RANK: gl.constexpr, NG: gl.constexpr, BLOCK_N: gl.constexpr,
                    DT: gl.constexpr, DEQ_L: gl.constexpr, SC_L: gl.constexpr):
        # K_lat[n, c] = code[n, c] * scale[n, g(c)], rounded to the q dtype (as the Triton
        # kernel's dequantise path), one scale group at a time: shared codes -> registers ->
        # the shared K tile the dots read
        GROUP: gl.constexpr = RANK // NG
        sc = sc_buf.load(SC_L)
        cols = gl.arange(0, NG, layout=gl.SliceLayout(0, SC_L))
        for g in gl.static_range(NG):
            sc_g = gl.sum(gl.where(cols[None, :] == g, sc, 0.0), axis=1)
            sc_g = gl.convert_layout(sc_g, gl.SliceLayout(1, DEQ_L))
            codes = codes_buf.slice(g * GROUP, GROUP, dim=1).load(DEQ_L)
            vals = codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * sc_g[:, None]
            k_lat_s.slice(g * GROUP, GROUP, dim=1).store(vals.to(DT))

    @gluon.jit
    def _decode_wgmma_kernel(q_ptr, kv_ptr, bt_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr,
                             out_ptr, lse_ptr, po_ptr, plse_ptr, bt_stride, partial_cap, qk_scale, SQ, H,
                             PAGE: gl.constexpr, RANK: gl.constexpr, ROPE: gl.constexpr, GROUP: gl.constexpr,
                             TOKEN_STRIDE: gl.constexpr, FP8: gl.constexpr, BLOCK_M: gl.constexpr,
                             BLOCK_N: gl.constexpr, PDL: gl.constexpr):
        gl.static_assert(BLOCK_M == 64)
        gl.static_assert(gl.num_warps() == 8)
        wait_prior_grid(PDL)  # before any read of the plan (kernels/pdl.py)
        DT: gl.constexpr = q_ptr.dtype.element_ty
        D: gl.constexpr = RANK + ROPE
        NG: gl.constexpr = RANK // GROUP
        # [4, 2]: the four warps of a warpgroup split the 64 rows, the two warpgroups the N axis
        S_L: gl.constexpr = wgmma_layout([4, 2], BLOCK_N // 2)
        ACC_L: gl.constexpr = wgmma_layout([4, 2], RANK // 2)
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
        ROW_A: gl.constexpr = gl.SliceLayout(1, ACC_L)
        COL_A: gl.constexpr = gl.SliceLayout(0, ACC_L)
        # copies: 16-byte vectors along a row (8 16-bit values; 16 e4m3 codes)
        Q_L: gl.constexpr = row_copy_layout(8, 32, 8)
        if FP8:
            LAT_L: gl.constexpr = row_copy_layout(16, 32, 8)
        else:
            LAT_L: gl.constexpr = Q_L
        ROPE_L: gl.constexpr = row_copy_layout(8, 8, 8)
        # FP8: a key's NG scale words; a group's codes read back 16 a thread, 4 rows x 128 a warp
        SC_L: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, NG], threads_per_warp=[32, 1],
                                              warps_per_cta=[2, 4], order=[1, 0])
        DEQ_L: gl.constexpr = row_copy_layout(16, 8, 8)
        LAT_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, RANK], DT)
        ROPE_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], DT)
        QLAT_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, RANK], DT)
        QROPE_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, ROPE], DT)
        P_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], DT)
        PLAIN_SH: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])

        q_lat_s = gl.allocate_shared_memory(DT, [BLOCK_M, RANK], QLAT_SH)
        q_rope_s = gl.allocate_shared_memory(DT, [BLOCK_M, ROPE], QROPE_SH)
        k_rope_s = gl.allocate_shared_memory(DT, [2, BLOCK_N, ROPE], ROPE_SH)
        p_s = gl.allocate_shared_memory(DT, [BLOCK_M, BLOCK_N], P_SH)
        if FP8:
            # two tiles of codes and scales in flight, one dequantised K tile
            codes_s = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, RANK], PLAIN_SH)
            sc_s = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N, NG], PLAIN_SH)
            k_lat_s = gl.allocate_shared_memory(DT, [1, BLOCK_N, RANK], LAT_SH)
        else:
            k_lat_s = gl.allocate_shared_memory(DT, [2, BLOCK_N, RANK], LAT_SH)
            codes_s = k_lat_s
            sc_s = k_lat_s

        ROWS = SQ * H
        # the part, and the rows and keys in the dot layouts (masks)
        b_first, t_first, j_first, b_end, t_end, b_last, row0, ctx_w, m_s, n_s = program_rows(
            part_ptr, ctxw_ptr, BLOCK_M, BLOCK_N, S_L)
        row_ok_s = m_s < ROWS
        tok_s = m_s // H

        for b in range(b_first, b_last + 1):
            b64 = b.to(gl.int64)
            seq_len, t0, t1, nsplit, p_row = request_span(b, b_first, t_first, j_first, b_end, t_end, seq_ptr,
                                                          nsplit_ptr, off_ptr, BLOCK_N)
            if t1 > t0:
                bt_row = bt_ptr + b64 * bt_stride
                ctx = gl.load(ctx_ptr + b64 * ctx_w + tok_s, mask=row_ok_s & (tok_s < ctx_w), other=0)
                # every warp is done with the shared buffers of the previous request
                gl.thread_barrier()
                # q (padding rows: zeros) and tile t0: copy group 0
                copy_q_rows(q_ptr + b64 * (ROWS * D), row0, ROWS, q_lat_s, q_rope_s, RANK, ROPE, Q_L,
                            ROPE_L)
                _issue_tile(codes_s.index(0), k_rope_s.index(0), sc_s.index(0), kv_ptr, bt_row, t0, seq_len,
                            tile_page(bt_row, t0, t1, PAGE, BLOCK_N), PAGE, RANK, ROPE, NG, TOKEN_STRIDE, BLOCK_N, FP8,
                            LAT_L, ROPE_L, SC_L)
                async_copy.commit_group()

                m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)
                l_i = gl.full([BLOCK_M], 0.0, gl.float32, ROW_S)
                # carried through the loop as an in-flight wgmma accumulator
                acc = warpgroup_mma_init(gl.full([BLOCK_M, RANK], 0.0, gl.float32, ACC_L))
                pg_next = tile_page(bt_row, t0 + 1, t1, PAGE, BLOCK_N)
                for tile in range(t0, t1):
                    buf = (tile - t0) % 2
                    # the PV dot of the previous tile (which read the other buffer, or the one
                    # dequantised K tile, and P) is done in this warpgroup; the barrier makes it
                    # done in both before they are reused
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                    gl.thread_barrier()
                    _issue_tile(codes_s.index(1 - buf), k_rope_s.index(1 - buf), sc_s.index(1 - buf), kv_ptr,
                                bt_row, tile + 1, gl.where(tile + 1 < t1, seq_len, 0), pg_next, PAGE, RANK, ROPE, NG,
                                TOKEN_STRIDE, BLOCK_N, FP8, LAT_L, ROPE_L, SC_L)
                    async_copy.commit_group()
                    # the page of the tile after, for the next trip's copies
                    pg_next = tile_page(bt_row, tile + 2, t1, PAGE, BLOCK_N)
                    # this tile's group (all but the one just issued) has landed, for every thread,
                    # and is visible to the tensor cores' (async proxy) reads
                    async_copy.wait_group(1)
                    if FP8:
                        gl.thread_barrier()
                        k_lat = k_lat_s.index(0)
                        _dequantise(codes_s.index(buf), sc_s.index(buf), k_lat, RANK, NG, BLOCK_N, DT, DEQ_L,
                                    SC_L)
                    else:
                        k_lat = k_lat_s.index(buf)
                    fence_async_shared()
                    gl.thread_barrier()
                    acc, m_i, l_i = rows_tile_step(q_lat_s, q_rope_s, k_lat, k_rope_s.index(buf), p_s, acc, m_i, l_i,
                                                   ctx, tile, n_s, seq_len, qk_scale, S_L, ROW_A)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                # the trailing (empty) copy group
                async_copy.wait_group(0)

                store_rows_result(acc, m_i, l_i, row0, b64, nsplit, p_row, partial_cap, out_ptr, lse_ptr,
                                  po_ptr, plse_ptr, ROWS, SQ, H, BLOCK_M, RANK, ROW_S, ROW_A, COL_A)


def mark_unavailable(error: BaseException) -> None:
    """Record that the kernel failed to build (``error``: Triton's compile or resource error)
    and warn once; ``wgmma_plan`` then sends every launch to the Triton kernel."""
    global UNAVAILABLE
    if UNAVAILABLE is None:
        UNAVAILABLE = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
        warnings.warn(f"mla_fuzz.kernels.decode_wgmma: the Hopper Gluon decode did not build with this Triton "
                      f"({UNAVAILABLE}); using the Triton decode kernel instead", RuntimeWarning, stacklevel=3)


def launch_decode_wgmma(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits,
                        split_offsets, out, lse, partial_o, partial_lse, *, softmax_scale_log2: float, rank: int,
                        rope_dim: int, fp8_group: int, block_m: int, block_n: int) -> None:
    """Launch this kernel (arguments as ``decode_split.launch_decode_split``; the caller has
    checked ``wgmma_plan``). Shapes: q ``[B, s_q, h, rank + rope]`` (bf16/fp16, the cache's
    dtype); kv_cache ``[num_blocks, page, rank + rope]``; the rest as the Triton launcher."""
    B, s_q, h, _ = q.shape
    num_parts = part_info.shape[0] - 1
    m_blocks = -(-(s_q * h) // block_m)
    pdl = pdl_on(q)
    _decode_wgmma_kernel[(num_parts, m_blocks)](
        q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits, split_offsets,
        out, lse, partial_o, partial_lse, block_table.shape[1], partial_o.shape[0], softmax_scale_log2, s_q, h,
        PAGE=kv_cache.shape[1], RANK=rank, ROPE=rope_dim, GROUP=fp8_group if fp8_group > 0 else rank,
        TOKEN_STRIDE=kv_cache.shape[-1], FP8=kv_cache.dtype == torch.uint8, BLOCK_M=block_m, BLOCK_N=block_n,
        PDL=pdl, num_warps=8, launch_pdl=pdl)
