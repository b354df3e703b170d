"""The route table: which decode kernel runs a launch, with which blocks, and why.

Two tables, both declarative:

- ``ROUTES`` -- what ``default_config`` picks from *static* facts (platform, cache kind, query
  rows per request ``s_q * h``, the padded batch): the first row that matches gives the kernel
  (``DecodeConfig.kernel``), its blocks and the reason (``DecodeConfig.reason``, with the
  measurement behind it; ``docs/kernel-performance.md`` has them all). A captured CUDA graph's
  launch shapes therefore depend only on what was fixed at capture time.
- ``KERNELS`` -- what each kernel needs at launch (block shape, cache kind, and the facts only
  the tensors tell: dtypes, device, cache layout for TMA) and where a launch goes when it
  cannot run (``fallback``). ``resolve`` walks that chain from ``DecodeConfig.kernel`` and says
  why each step was taken; ``launch_decode`` (``ops.decode_split``) launches the kernel it
  ends at. The portable Triton kernel (``kernels/decode_split.py``) runs anything; the others
  are Hopper Gluon kernels (``kernels/hopper/``).

Cache kinds: ``"16-bit"`` (bf16 / fp16), ``"fp8"`` (FlashMLA's uint8 token, scales inside) and
``"fp8_e4m3"`` (per-tensor-scaled float8_e4m3fn rows, vLLM / SGLang / FlashInfer's layout,
scale from a device pointer). No Gluon kernel reads the last; its rows name the Triton kernel
and say why, on Hopper too, and ``resolve`` refuses it to a Gluon kernel a config names.

A test picks a route by its row (``route_config(ROUTES[i], spec, s_q, device)``, or
``default_config(...).with_(kernel=...)``) instead of switching module globals; a Gluon kernel
that fails to build (another Triton's Gluon) is reported once and every later launch takes the
Triton kernel with the same blocks (``mark_unavailable``).
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from mla_fuzz.mla_ref import ModelSpec

from .config import KERNEL_NAMES, DecodeConfig, interpreting, sm_count
from .decode_split import launch_decode_split
from .hopper import gluon_parts
from .hopper.decode_wgmma import launch_decode_wgmma
from .hopper.decode_wgmma_kt import kt_descriptors_available, launch_decode_wgmma_kt
from .hopper.decode_wgmma_pp import launch_decode_wgmma_pp
from .hopper.decode_wgmma_rs import launch_decode_wgmma_rs, rs_descriptors_available
from .hopper.decode_wgmma_ws import launch_decode_wgmma_ws
from .hopper.decode_wgmma_ws64 import launch_decode_wgmma_ws64

try:  # Triton's compile / resource errors (a Gluon kernel that fails to build)
    from triton.errors import TritonError
except ImportError:  # pragma: no cover - an older Triton, without Gluon either: nothing to catch
    TritonError = ()

__all__ = ["Route", "ROUTES", "Kernel", "KERNELS", "LAUNCHERS", "default_config", "route_config", "find_route",
           "resolve", "launch_decode", "mark_unavailable", "SPLIT_ROWS_MAX_BATCH", "FP8_GROUP"]

_LOG2E = 1.4426950408889634

#: the largest padded batch whose h=16 x 2 launches take two 16-row blocks on Hopper (``ROUTES``)
SPLIT_ROWS_MAX_BATCH = 4
#: the FP8 scale group the Gluon kernels are written for (DeepSeek's 128)
FP8_GROUP = 128
#: why the Gluon kernels cannot be built in this process (None: they can, as far as is known);
#: set by ``mark_unavailable`` on the first build failure
UNAVAILABLE: Optional[str] = None


# --------------------------------------------------------------------------- the route table

@dataclass(frozen=True)
class Route:
    """One row of ``ROUTES``. Matches a launch when its platform, cache kind, decode kind, query
    rows per request (``rows``, inclusive) and padded batch (``max_batch``: at most, a known
    batch; None: any) do. Gives the kernel, its blocks, the parts' minimum tiles, the FP8 path
    of the Triton kernel (``fp8_grouped``) and ``why``."""

    platform: str            # "hopper" (compute capability 9.x, Gluon, rank 512 + rope 64), "cuda", "cpu"
    cache: str               # "16-bit", "fp8", "fp8_e4m3" or "any"
    decode: str              # "dense", "sparse" or "any"
    rows: tuple              # (lo, hi) query rows per request
    max_batch: Optional[int]
    kernel: str
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    min_tiles: int
    fp8_grouped: bool
    why: str

    @property
    def name(self) -> str:
        """``platform/cache/decode/rows[/B<=n]: kernel``, a stable id for tests."""
        lo, hi = self.rows
        rows = f"{lo}-{hi}" if hi < _ANY else f"{lo}+"
        batch = f"/B<={self.max_batch}" if self.max_batch is not None else ""
        return f"{self.platform}/{self.cache}/{self.decode}/{rows}{batch}:{self.kernel}"


_ANY = 1 << 30
R = Route
#: First match wins. Hopper rows need a CUDA device of compute capability 9.x, an importable
#: Gluon, a dense decode and the shapes the Gluon kernels are written for (rank 512 + rope 64,
#: FP8 groups of 128); the rest of CUDA takes the "cuda" rows, the interpreter the "cpu" ones.
#: (platform, cache, decode, rows, max_batch, kernel, block_m, block_n, warps, stages, min_tiles,
#: fp8_grouped, why)
ROUTES: tuple = (
    # per-tensor e4m3 (fp8_e4m3): a declared decision, not a fallback -- the Gluon kernels read
    # FlashMLA's token (codes | group scales | bf16 rope) or 16-bit keys, none a per-tensor scale
    # from a device pointer, so the portable Triton kernel runs it on every platform. Its keys are
    # staged as codes, widened to fp32 for the scale, then rounded to q's dtype for the dots, so a
    # tile holds three copies of the keys: the 16-bit rows' 128- and 64-key tiles need 354-391 KB of
    # shared memory at rank 512 (more than an H100/H200 has, measured 2026-11-28); these 32-key
    # (16-key off Hopper) tiles fit. Correct, not tuned: nothing here was measured for speed.
    R("hopper", "fp8_e4m3", "dense", (1, 16), None, "triton", 16, 32, 4, 2, 2, False,
      "per-tensor e4m3 cache: no Gluon kernel reads it; the Triton kernel with 32-key tiles (the 16-bit "
      "rows' tiles exceed shared memory at rank 512 with the widened keys, h200-2026-11-28-fp8-e4m3-smem.json; untuned)"),
    R("hopper", "fp8_e4m3", "dense", (17, _ANY), None, "triton", 32, 32, 4, 2, 2, False,
      "per-tensor e4m3 cache: no Gluon kernel reads it; the Triton kernel with 32-row blocks of 32-key tiles "
      "(the 16-bit rows' tiles exceed shared memory at rank 512 with the widened keys, "
      "h200-2026-11-28-fp8-e4m3-smem.json; untuned)"),
    R("cuda", "fp8_e4m3", "dense", (1, 16), None, "triton", 16, 16, 4, 2, 2, False,
      "per-tensor e4m3 cache up to 16 rows: 16-key tiles, within the shared memory of pre-Hopper GPUs "
      "at rank 512 with the widened keys (h200-2026-11-28-fp8-e4m3-smem.json; untuned)"),
    R("cuda", "fp8_e4m3", "dense", (17, _ANY), None, "triton", 32, 16, 4, 2, 2, False,
      "per-tensor e4m3 cache above 16 rows: 32-row blocks of 16-key tiles, within the shared memory of "
      "pre-Hopper GPUs at rank 512 with the widened keys (h200-2026-11-28-fp8-e4m3-smem.json; untuned)"),
    # the sparse decode (its own kernel, the "cuda" rows on every GPU): 32-key tiles up to 32 rows
    # (16 rows of 128-key tiles needed 371 KB), the 16-bit blocks above (they fit: 128 rows, H200)
    R("cuda", "fp8_e4m3", "sparse", (1, 16), None, "triton", 16, 32, 4, 2, 2, False,
      "per-tensor e4m3 sparse decode up to 16 rows: 32-key tiles (the 16-bit rows' 128-key tiles exceed "
      "shared memory with the widened keys, h200-2026-11-28-fp8-e4m3-smem.json; untuned)"),
    R("cuda", "fp8_e4m3", "sparse", (17, 32), None, "triton", 32, 32, 4, 2, 2, False,
      "per-tensor e4m3 sparse decode, 17-32 rows: 32-key tiles (h200-2026-11-28-fp8-e4m3-smem.json; untuned)"),
    R("cuda", "fp8_e4m3", "sparse", (33, _ANY), None, "triton", 64, 64, 8, 2, 2, False,
      "per-tensor e4m3 sparse decode above 32 rows: the 16-bit blocks (measured on 16-bit caches, "
      "h100-2026-11-26-config-sweep-pageconst.json; untuned for e4m3)"),
    R("hopper", "fp8", "dense", (17, 32), SPLIT_ROWS_MAX_BATCH, "wgmma_rs", 16, 64, 4, 1, 2, False,
      "h=16 x 2 at small batches: two 16-row blocks, one program a part and block; 1.06-1.30x the one-block "
      "route at B 1-2 (h100-2026-11-27-split-rows-ab.json)"),
    R("hopper", "16-bit", "dense", (17, 32), SPLIT_ROWS_MAX_BATCH, "wgmma_kt", 16, 64, 4, 1, 2, False,
      "h=16 x 2 at small batches: two 16-row blocks; 1.04-1.23x the 32-row block at B 1-2 "
      "(h100-2026-11-27-split-rows-ab.json)"),
    R("hopper", "fp8", "dense", (1, 16), None, "wgmma_rs", 16, 64, 4, 1, 4, False,
      "FP8 up to 16 rows: codes converted in the dots' register operands, TMA copies; 1.06-1.31x the "
      "warp-specialised kernel (h100-2026-11-27-kernel-24*.json)"),
    R("hopper", "16-bit", "dense", (1, 16), None, "wgmma_kt", 16, 64, 4, 1, 4, False,
      "16-bit up to 16 rows: TMA keys-on-M kernel, parts of four 64-key tiles; 1.00-1.24x the Triton "
      "kernel's blocks (h100-2026-11-27-wgmma-kt-ab.json)"),
    R("hopper", "16-bit", "dense", (17, 32), None, "wgmma_kt", 32, 64, 4, 1, 4, False,
      "16-bit 17-32 rows: TMA keys-on-M kernel, one 32-row block; 1.01-1.26x the 64-row Gluon blocks "
      "(h100-2026-11-27-wgmma-kt-ab.json)"),
    R("hopper", "fp8", "dense", (17, _ANY), None, "wgmma_ws64", 64, 64, 8, 1, 2, False,
      "FP8 64-row blocks: a producer partition dequantises the next tile while the dots run; 1.06-1.30x "
      "the one-partition kernel at h=128 (h100-2026-11-26-kernel-16*.json)"),
    R("hopper", "16-bit", "dense", (33, _ANY), None, "wgmma_pp", 64, 64, 8, 2, 2, False,
      "16-bit 64-row blocks: the two warpgroups on alternate tiles (the 64-row kernel where fewer than "
      "two row blocks or 16 request x block pairs); 0.94-1.42x it at h=128 (h100-2026-11-26-wgmma-pp-ab.json)"),
    R("cuda", "any", "any", (1, 16), None, "triton", 16, 128, 8, 2, 2, True,
      "up to 16 rows: 128-key tiles, 2 stages; FP8 grouped fp16 dots with twin loads "
      "(h100-2026-11-26-config-sweep-pageconst.json)"),
    R("cuda", "16-bit", "any", (17, 32), None, "triton", 32, 128, 8, 3, 2, False,
      "16-bit 17-32 rows: 128-key tiles at 3 stages, 1.04x 64 keys / 2 stages "
      "(h100-2026-11-26-config-sweep-pageconst.json)"),
    R("cuda", "fp8", "any", (17, _ANY), None, "triton", 64, 128, 8, 1, 1, False,
      "FP8 above 16 rows: the 64-row block, dequantised, P through memory, parts of one tile "
      "(h100-2026-11-26-fp8-pmem.json, -fp8-m64-h16.json, -fp8-h128-min-tiles.json)"),
    R("cuda", "16-bit", "any", (33, _ANY), None, "triton", 64, 64, 8, 2, 2, False,
      "16-bit above 32 rows: 64-row blocks of 64-key tiles, 2 stages (h100-2026-11-26-config-sweep-pageconst.json)"),
    # the interpreter: every query row of a request in one block, 64-key tiles (32 sparse): an
    # interpreted op costs the same at any size, so tiles are as large as coverage allows, still two
    # or more for requests past 64 keys; 5 parts (cuts fall inside requests); FP8 dequantises up to 16
    # and above 32 rows and takes the grouped path at 17-32, so both FP8 paths get fuzzed
    R("cpu", "any", "dense", (1, 16), None, "triton", 16, 64, 4, 1, 1, False, "interpreter: one row block"),
    R("cpu", "any", "dense", (17, 32), None, "triton", 32, 64, 4, 1, 1, True, "interpreter: one row block, FP8 grouped"),
    R("cpu", "any", "dense", (33, _ANY), None, "triton", 64, 64, 4, 1, 1, False, "interpreter: 64-row blocks"),
    R("cpu", "any", "sparse", (1, 16), None, "triton", 16, 32, 4, 1, 1, False, "interpreter, sparse: 32-key tiles"),
    R("cpu", "any", "sparse", (17, 32), None, "triton", 32, 32, 4, 1, 1, True, "interpreter, sparse: 32-key tiles"),
    R("cpu", "any", "sparse", (33, _ANY), None, "triton", 64, 32, 4, 1, 1, False, "interpreter, sparse: 32-key tiles"),
)
del R

#: interpreter runs: programs along the KV axis (an odd count, so cuts fall inside requests)
CPU_PARTS = 5


def _capability(device: torch.device, capability: Optional[tuple]) -> tuple:
    if capability is not None:
        return tuple(capability)
    try:
        return tuple(torch.cuda.get_device_capability(device))
    except Exception:  # no CUDA here (tests asking for the CUDA defaults): the H100 they were tuned on
        return (9, 0)


def _platform(spec: ModelSpec, device: torch.device, fp8: bool, sparse: bool, capability: Optional[tuple]) -> str:
    if device.type != "cuda":
        return "cpu"
    hopper = (gluon_parts.gluon is not None and _capability(device, capability)[0] == 9 and not sparse
              and (spec.kv_lora_rank, spec.qk_rope_head_dim) == (512, 64) and (not fp8 or spec.fp8_group == FP8_GROUP))
    return "hopper" if hopper else "cuda"


def _cache_kind(fp8: bool, fp8_e4m3: bool) -> str:
    if fp8 and fp8_e4m3:
        raise ValueError("fp8 (FlashMLA's token) and fp8_e4m3 (per-tensor e4m3) are two cache layouts: give one")
    return "fp8" if fp8 else "fp8_e4m3" if fp8_e4m3 else "16-bit"


def find_route(spec: ModelSpec, s_q: int, device: Optional[torch.device] = None, *, fp8: bool = False,
               sparse: bool = False, batch: Optional[int] = None, capability: Optional[tuple] = None,
               fp8_e4m3: bool = False) -> Route:
    """The first row of ``ROUTES`` matching these static facts (arguments as ``default_config``)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    cache = _cache_kind(fp8, fp8_e4m3)
    platform = _platform(spec, device, fp8, sparse, capability)
    rows = s_q * spec.num_heads
    decode = "sparse" if sparse else "dense"
    for r in ROUTES:
        if (r.platform == platform and r.cache in (cache, "any") and r.decode in (decode, "any")
                and r.rows[0] <= rows <= r.rows[1]
                and (r.max_batch is None or (batch is not None and batch <= r.max_batch))):
            return r
    raise AssertionError(f"no route for {platform}/{cache}/{decode}/{rows} rows")  # pragma: no cover - the table covers all


def route_config(route: Route, spec: ModelSpec, s_q: int, device: Optional[torch.device] = None) -> DecodeConfig:
    """The launch config of ``route`` for ``s_q`` tokens of ``spec`` on ``device``: the row's kernel and
    blocks; parts: one program a row block and SM on CUDA (``num_parts * m_blocks = SMs``: better than two
    a SM in every sweep), ``CPU_PARTS`` under the interpreter; the combine: 16-row blocks in 128-column
    programs on CUDA (1.02-1.04x at h=16, h100-2026-11-26-combine-cols.json), one block of the rows on CPU."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    rows = s_q * spec.num_heads
    cpu = route.platform == "cpu"
    m_blocks = -(-rows // route.block_m)
    return DecodeConfig(block_m=route.block_m, block_n=route.block_n,
                        num_parts=CPU_PARTS if cpu else max(1, sm_count(device) // m_blocks),
                        min_tiles_per_part=route.min_tiles, num_warps=route.num_warps, num_stages=route.num_stages,
                        combine_block_m=route.block_m if cpu else 16,
                        combine_col_blocks=1 if cpu else _combine_col_blocks(spec.kv_lora_rank),
                        fp8_grouped=route.fp8_grouped and route.cache != "16-bit",
                        kernel=route.kernel, reason=f"{route.name}: {route.why}")


def default_config(spec: ModelSpec, s_q: int, device: Optional[torch.device] = None, *, fp8: bool = False,
                   sparse: bool = False, batch: Optional[int] = None,
                   capability: Optional[tuple] = None, fp8_e4m3: bool = False) -> DecodeConfig:
    """The configuration ``mla_decode`` and the backend use unless given one: ``ROUTES``' first
    match (``find_route``) made into a config (``route_config``); an FP8 config takes the grouped
    path only where its cache is FP8 (FlashMLA's token, ``fp8``).

    ``fp8_e4m3``: the per-tensor-scaled float8_e4m3fn cache (its own rows: the Triton kernel
    everywhere); exclusive with ``fp8``.
    ``batch``: the padded batch the launches are for (a route may hold only for small ones; None:
    no batch, the routes of larger batches). ``sparse``: the sparse top-k decode (pass ``s_q=1``:
    one (request, token) row a unit), which has its own kernel. ``capability``: the CUDA device's
    compute capability (None: read from ``device``; on a machine without CUDA, an H100's)."""
    route = find_route(spec, s_q, device, fp8=fp8, sparse=sparse, batch=batch, capability=capability,
                       fp8_e4m3=fp8_e4m3)
    cfg = route_config(route, spec, s_q, device)
    return cfg if fp8 or not cfg.fp8_grouped else cfg.with_(fp8_grouped=False, reason=cfg.reason)


def _combine_col_blocks(rank: int) -> int:
    """Column blocks of the GPU combine: 128-column blocks where the rank allows (at least one,
    and a power-of-two block, ``DecodeConfig.combine_col_blocks``)."""
    blocks = max(1, rank // 128)
    while blocks > 1 and (rank % blocks or (rank // blocks) & (rank // blocks - 1)):
        blocks -= 1
    return blocks


# --------------------------------------------------------------------------- the kernel table

@dataclass(frozen=True)
class Launch:
    """The facts of one decode launch a kernel's checks read (no device values)."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    rank: int
    rope_dim: int
    fp8_group: int
    block_m: int
    block_n: int
    num_warps: int
    capability: Optional[tuple] = None

    @property
    def fp8(self) -> bool:
        return self.kv_cache.dtype == torch.uint8

    @property
    def cache(self) -> str:
        """The cache kind, as ``Kernel.cache`` names it."""
        return "fp8" if self.fp8 else "fp8_e4m3" if self.kv_cache.dtype == torch.float8_e4m3fn else "16-bit"

    @property
    def rows(self) -> int:
        return self.q.shape[1] * self.q.shape[2]


@dataclass(frozen=True)
class Kernel:
    """One row of ``KERNELS``: the block shapes ``(block_m, block_n, num_warps)`` and cache kind a
    kernel is written for, its own launch-time check (None: can run; else why not) and where a
    launch it refuses goes."""

    name: str
    where: str
    blocks: Optional[tuple]            # None: any
    cache: str                         # "16-bit", "fp8" or "any" (no Gluon kernel takes "fp8_e4m3")
    check: Optional[Callable[[Launch], Optional[str]]]
    fallback: Optional[str]


def _hopper_reason(x: Launch) -> Optional[str]:
    """What keeps every Gluon kernel off this launch: no Gluon, a build failure, not a Hopper
    CUDA tensor, dtypes (FP8: bf16 queries, groups of 128, the codes | scales | rope token; 16-bit:
    q of the cache's dtype) or the spec's shapes (rank 512 + rope 64: the shared-memory budgets)."""
    if gluon_parts.gluon is None:
        return "this Triton has no Gluon"
    if UNAVAILABLE is not None:
        return f"the Gluon kernels failed to build in this process: {UNAVAILABLE}"
    cap = x.capability
    if cap is None:
        if x.q.device.type != "cuda":
            return "not a CUDA tensor"
        cap = _device_capability(x.q.device.index if x.q.device.index is not None else torch.cuda.current_device())
    if tuple(cap)[0] != 9:
        return f"compute capability {tuple(cap)} is not Hopper (9.x)"
    q, kv = x.q, x.kv_cache
    if x.fp8:
        if q.dtype != torch.bfloat16:
            return f"FP8 cache with {q.dtype} queries (the Gluon kernels take bf16 queries)"
        if x.fp8_group != FP8_GROUP:
            return f"FP8 scale group of {x.fp8_group} (the Gluon kernels are written for {FP8_GROUP})"
        if kv.shape[-1] != x.rank + 4 * (x.rank // x.fp8_group) + 2 * x.rope_dim:
            return "FP8 token layout is not codes + fp32 scales + bf16 rope"
    elif kv.dtype not in (torch.bfloat16, torch.float16) or q.dtype != kv.dtype:
        return "not a 16-bit or FP8 cache with q of the cache's dtype"
    if (x.rank, x.rope_dim) != (512, 64):
        return f"rank {x.rank} + rope {x.rope_dim} (the shared-memory budgets are sized for 512 + 64)"
    return None


@functools.lru_cache(maxsize=None)
def _device_capability(index: int) -> tuple:
    return tuple(torch.cuda.get_device_capability(index))


def _tma_rows_reason(kv_cache: torch.Tensor, token_bytes: int, block_n: int) -> Optional[str]:
    """What keeps TMA from copying ``block_n``-key tiles of a contiguous cache (``[num_blocks, page,
    ...]``, ``token_bytes`` a key) in boxes of ``min(page, block_n)`` rows a page into 128-byte-swizzled
    shared memory: the base not 16-byte aligned, rows not a multiple of 16 bytes, pages that neither
    hold whole tiles nor fit whole in one, boxes not a multiple of the swizzle's 8 rows, more rows than
    an int32 coordinate. None: nothing."""
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


def _pp_reason(x: Launch) -> Optional[str]:
    """The ping-pong kernel needs two or more 64-row blocks and 16+ (request, row block) pairs:
    with one row block every tile is read by one program and its one tile a warpgroup exposes the
    copies (0.81-0.97x the 64-row kernel), at B=1 its hand-overs cost more than they overlap
    (0.88-0.97x; h100-2026-11-26-wgmma-pp-ab.json, -kernel-17.json)."""
    m_blocks = -(-x.rows // 64)
    if m_blocks < 2 or x.q.shape[0] * m_blocks < 16:
        return f"{m_blocks} row block(s) x {x.q.shape[0]} requests (the ping-pong kernel takes 2+ blocks, 16+ pairs)"
    return None


def _rs_reason(x: Launch) -> Optional[str]:
    """The register-operand kernel copies each tile with TMA (``_tma_rows_reason``) from a contiguous
    ``[num_blocks, page, token bytes]`` cache."""
    if not rs_descriptors_available():
        return "this Triton's Gluon has no TMA tensor descriptor"
    if x.kv_cache.dim() != 3 or not x.kv_cache.is_contiguous():
        return "cache not a contiguous [num_blocks, page_size, bytes_per_token] tensor"
    return _tma_rows_reason(x.kv_cache, x.kv_cache.shape[-1], x.block_n)


def _ws_reason(x: Launch) -> Optional[str]:
    """The warp-specialised few-row kernel holds every query row of a request in its one block."""
    if x.rows > x.block_m:
        return f"{x.rows} query rows in a {x.block_m}-row block (the warp-specialised kernel takes one block)"
    return None


def _kt_reason(x: Launch) -> Optional[str]:
    """The TMA keys-on-M kernel copies each tile with TMA (``_tma_rows_reason``) from a contiguous
    ``[num_blocks, page, 1, d_qk]`` cache."""
    if not kt_descriptors_available():
        return "this Triton's Gluon has no TMA tensor descriptor"
    kv = x.kv_cache
    if kv.dim() != 4 or kv.shape[2] != 1 or not kv.is_contiguous():
        return "cache not a contiguous [num_blocks, page_size, 1, d_qk] tensor"
    return _tma_rows_reason(kv, kv.shape[-1] * kv.element_size(), x.block_n)


K = Kernel
#: (name, where, blocks (block_m, block_n, num_warps), cache, own check, fallback)
KERNELS: dict = {k.name: k for k in (
    K("triton", "kernels/decode_split.py", None, "any", None, None),
    K("wgmma", "kernels/hopper/decode_wgmma.py", ((64, 64, 8),), "16-bit", None, "triton"),
    K("wgmma_pp", "kernels/hopper/decode_wgmma_pp.py", ((64, 64, 8),), "16-bit", _pp_reason, "wgmma"),
    K("wgmma_ws64", "kernels/hopper/decode_wgmma_ws64.py", ((64, 64, 8),), "fp8", None, "triton"),
    K("wgmma_rs", "kernels/hopper/decode_wgmma_rs.py", ((16, 64, 4),), "fp8", _rs_reason, "wgmma_ws"),
    K("wgmma_ws", "kernels/hopper/decode_wgmma_ws.py", ((16, 64, 4),), "fp8", _ws_reason, "triton"),
    K("wgmma_kt", "kernels/hopper/decode_wgmma_kt.py", ((16, 64, 4), (32, 64, 4)), "16-bit", _kt_reason, "triton"),
)}
del K
assert tuple(KERNELS) == KERNEL_NAMES, "config.KERNEL_NAMES and KERNELS disagree"

#: each kernel's launcher (tests may wrap one with ``monkeypatch.setitem``)
LAUNCHERS: dict = {
    "wgmma": launch_decode_wgmma, "wgmma_pp": launch_decode_wgmma_pp, "wgmma_ws64": launch_decode_wgmma_ws64,
    "wgmma_rs": launch_decode_wgmma_rs, "wgmma_ws": launch_decode_wgmma_ws, "wgmma_kt": launch_decode_wgmma_kt,
}


def _refusal(kernel: Kernel, x: Launch) -> Optional[str]:
    if kernel.name == "triton":
        return None
    if (x.block_m, x.block_n, x.num_warps) not in kernel.blocks:
        return f"block {x.block_m}x{x.block_n} with {x.num_warps} warps (it takes {kernel.blocks})"
    if kernel.cache != x.cache:
        return f"a {x.cache if x.cache != 'fp8' else 'FP8'} cache (it takes {kernel.cache})"
    reason = _hopper_reason(x)
    if reason is None and kernel.check is not None:
        reason = kernel.check(x)
    return reason


def resolve(q: torch.Tensor, kv_cache: torch.Tensor, *, kernel: str, rank: int, rope_dim: int, fp8_group: int,
            block_m: int, block_n: int, num_warps: int, capability: Optional[tuple] = None) -> tuple:
    """``(kernel name, why)``: the kernel a launch runs, walking ``KERNELS``' fallbacks from
    ``kernel`` (``DecodeConfig.kernel``) past every one that refuses it; ``why`` names each refusal
    ("" when ``kernel`` itself runs). Host-side and static (dtypes, shapes, strides, alignment, the
    device): a captured graph bakes in the same choice. ``capability`` stands in for the device's
    (tests ask what a Hopper would run with CPU tensors)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {tuple(KERNELS)}, got {kernel!r}")
    x = Launch(q, kv_cache, rank, rope_dim, fp8_group, block_m, block_n, num_warps, capability)
    why = []
    name = kernel
    while True:
        k = KERNELS[name]
        reason = _refusal(k, x)
        if reason is None:
            return name, "; ".join(why)
        why.append(f"{name}: {reason}")
        name = k.fallback


def mark_unavailable(error: BaseException) -> None:
    """Record that a Gluon kernel failed to build (``error``: Triton's compile or resource error)
    and warn once; ``resolve`` then sends every launch to the Triton kernel."""
    global UNAVAILABLE
    if UNAVAILABLE is None:
        UNAVAILABLE = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
        warnings.warn(f"mla_fuzz.kernels: a Hopper Gluon decode did not build with this Triton ({UNAVAILABLE}); "
                      f"using the Triton decode kernel instead", RuntimeWarning, stacklevel=3)


def launch_decode(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits, split_offsets,
                  out, lse, partial_o, partial_lse, *, softmax_scale: float, rank: int, rope_dim: int, fp8_group: int,
                  block_m: int, block_n: int, num_warps: int, num_stages: int, fp8_grouped: bool = True,
                  kernel: str = "triton", k_scale: Optional[torch.Tensor] = None) -> None:
    """Launch the split-KV decode (arguments checked by ``ops.decode_split``; shapes as
    ``decode_split.launch_decode_split``) on the kernel ``resolve`` picks. A Gluon kernel that
    fails to build (compile or resource error, raised before anything runs) sends this launch and
    every later one to the Triton kernel (``mark_unavailable``). ``k_scale``: the fp8_e4m3 cache's
    fp32 ``[1]`` scale (only the Triton kernel reads that cache: ``resolve`` refuses it to the rest)."""
    dot_f32 = interpreting() or q.dtype == torch.float32
    if kernel != "triton" and not dot_f32:
        name, _ = resolve(q, kv_cache, kernel=kernel, rank=rank, rope_dim=rope_dim, fp8_group=fp8_group,
                          block_m=block_m, block_n=block_n, num_warps=num_warps)
        if name != "triton":
            try:
                LAUNCHERS[name](q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits,
                                split_offsets, out, lse, partial_o, partial_lse,
                                softmax_scale_log2=float(softmax_scale) * _LOG2E, rank=rank, rope_dim=rope_dim,
                                fp8_group=fp8_group, block_m=block_m, block_n=block_n)
                return
            except TritonError as e:
                mark_unavailable(e)
    launch_decode_split(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits,
                        split_offsets, out, lse, partial_o, partial_lse, softmax_scale=softmax_scale, rank=rank,
                        rope_dim=rope_dim, fp8_group=fp8_group, block_m=block_m, block_n=block_n,
                        num_warps=num_warps, num_stages=num_stages, dot_f32=dot_f32, fp8_grouped=fp8_grouped,
                        k_scale=k_scale)
