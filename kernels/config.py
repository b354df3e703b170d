"""Static launch configuration of the Triton MLA kernels and the host-side switches.

Everything here is decided on the host from *static* facts (the spec, the query shape,
the device, the environment) — never from device values — so a captured CUDA graph's
launch shapes depend only on what was fixed at capture time.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional

import torch

from mla_ref import ModelSpec

__all__ = ["DecodeConfig", "interpreting", "default_config", "next_pow2", "check_spec_supported"]


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``).

    Read at every launch rather than cached, because the test-suite sets the variable in
    conftest before the first launch and a cached value would be taken too early.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    """Smallest power of two ``>= max(n, 1)``."""
    return 1 << max(int(n) - 1, 0).bit_length()


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def check_spec_supported(spec: ModelSpec) -> None:
    """ValueError unless the kernels can run ``spec``.

    ``tl.arange`` ranges must be powers of two and the interpreter's ``tl.dot`` needs every
    dim >= 16, so rank and rope are powers of two >= 16; the FP8 group is a power of two so
    a ``[rank]`` row reshapes into ``[groups, group]``; rank % 4 == 0 keeps the FP8 scale
    words 4-byte aligned inside a token.
    """
    if not _is_pow2(spec.kv_lora_rank) or spec.kv_lora_rank < 16:
        raise ValueError(f"spec.kv_lora_rank must be a power of two >= 16 for the Triton kernels, "
                         f"got {spec.kv_lora_rank}")
    if not _is_pow2(spec.qk_rope_head_dim) or spec.qk_rope_head_dim < 16:
        raise ValueError(f"spec.qk_rope_head_dim must be a power of two >= 16 for the Triton kernels, "
                         f"got {spec.qk_rope_head_dim}")
    if not _is_pow2(spec.fp8_group):
        raise ValueError(f"spec.fp8_group must be a power of two for the Triton kernels, got {spec.fp8_group}")
    # FP8 tokens are addressed as base + token * bytes_per_token with the byte count a
    # compile-time constant; a 104-byte token (rank 64, groups of 32, rope 16) faulted with
    # "misaligned address" on an H200 (triton 3.6), while 16-byte multiples (656 at DeepSeek
    # size, 112 for ModelSpec.tiny) run. Refuse such specs up front rather than fault.
    if spec.fp8_bytes_per_token % 16:
        raise ValueError(f"spec.fp8_bytes_per_token must be a multiple of 16 for the Triton kernels "
                         f"(got {spec.fp8_bytes_per_token}: rank {spec.kv_lora_rank} + 4 per group of "
                         f"{spec.fp8_group} + 2 * rope {spec.qk_rope_head_dim}); try a smaller fp8_group")


@dataclass(frozen=True)
class DecodeConfig:
    """Tile shapes and launch knobs of the split-KV decode.

    - ``block_m``: query rows per program; rows are (token, head) pairs of one request
      flattened token-major, so the MTP tokens fold into the M dimension with the heads.
    - ``block_n``: keys per inner-loop tile; also the planner's unit of work (a *tile*).
    - ``num_parts``: programs along the KV axis (a persistent grid): the planner cuts the
      batch's total tile count into ``num_parts`` equal contiguous ranges; a request
      crossed by a cut is split, its pieces merged by the combine kernel.
    - ``min_tiles_per_part``: fewer parts are used when the batch is short, so a part
      never gets less than this many tiles (combine work would dominate).
    - ``num_warps`` / ``num_stages``: Triton's; ignored by the interpreter.
    - ``combine_block_m``: rows per combine program.
    - ``fp8_prefetch``: FP8 caches only — the kernel loads tile ``i+1``'s bytes into
      registers while tile ``i`` is dequantised (use with ``num_stages=1``).
    """

    block_m: int = 16
    block_n: int = 64
    num_parts: int = 132
    min_tiles_per_part: int = 2
    num_warps: int = 4
    num_stages: int = 2
    combine_block_m: int = 16
    fp8_prefetch: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "combine_block_m"):
            v = getattr(self, name)
            if not _is_pow2(v) or v < 16:
                raise ValueError(f"DecodeConfig.{name} must be a power of two >= 16, got {v}")
        for name in ("num_parts", "min_tiles_per_part", "num_warps", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"DecodeConfig.{name} must be a positive int, got {v!r}")

    def with_(self, **kw) -> "DecodeConfig":
        """A copy with some fields replaced."""
        return replace(self, **kw)

    def m_blocks(self, s_q: int, num_heads: int) -> int:
        """Programs along the query-row axis for ``s_q`` tokens of ``num_heads`` heads."""
        return -(-(s_q * num_heads) // self.block_m)

    def partial_capacity(self) -> int:
        """Rows of the fp32 partial buffer: at most ``2 * (num_parts - 1)`` pieces of
        requests that are split (each split request holds >= 1 of the ``num_parts - 1``
        cuts and has one more piece than cuts), and never less than one row."""
        return max(2 * self.num_parts, 1)


def _sm_count(device: torch.device) -> int:
    try:
        return torch.cuda.get_device_properties(device).multi_processor_count
    except Exception:  # pragma: no cover - no CUDA
        return 132


def default_config(spec: ModelSpec, s_q: int, device: Optional[torch.device] = None, *,
                   fp8: bool = False, sparse: bool = False) -> DecodeConfig:
    """The configuration ``mla_decode`` and the backend use unless given one.

    On CPU (interpreter) the tiles are the smallest the interpreter's ``tl.dot`` accepts and
    a handful of parts (an odd count, so cuts fall inside requests and splits get exercised).
    On CUDA the values are the best of the sweeps recorded in ``benchmarks/results`` (H200,
    Triton 3.6): the row block follows the query rows per request (heads x MTP tokens) —
    16/32 rows for the memory-bound small-head case, 64 rows to feed the tensor cores when
    there are many heads; one persistent program per SM (``num_parts * m_blocks = SMs``)
    beat two per SM in every swept case; FP8 with 16 rows prefetches its next tile into
    registers, larger row blocks do better with Triton's own pipelining.

    ``sparse``: the sparse top-k decode, whose unit is one (request, token) row (pass
    ``s_q=1``); on CPU its key tile is 32 wide — each tile is one interpreted loop trip, and
    the fuzzer's top-k of up to 64 still spans two tiles, so splits are exercised.
    """
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        return DecodeConfig(block_m=16, block_n=32 if sparse else 16, num_parts=5, min_tiles_per_part=1,
                            num_warps=4, num_stages=1, combine_block_m=16)
    rows = s_q * spec.num_heads
    prefetch = False
    if rows <= 16:
        block_m, block_n, warps, stages = (16, 64, 8, 1) if fp8 else (16, 128, 8, 2)
        prefetch = fp8
    elif rows <= 32:
        block_m, block_n, warps, stages = 32, 64, 8, 2
    else:
        block_m, block_n, warps, stages = 64, 64, 8, 2
    m_blocks = -(-rows // block_m)
    parts = max(1, _sm_count(device) // m_blocks)
    return DecodeConfig(block_m=block_m, block_n=block_n, num_parts=parts, min_tiles_per_part=2,
                        num_warps=warps, num_stages=stages, combine_block_m=16, fp8_prefetch=prefetch)
