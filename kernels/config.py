"""Static launch configuration of the decode kernels (``DecodeConfig``) and the host-side facts
it is checked against.

Everything here is decided on the host from *static* facts (the spec, the query shape, the
device) -- never from device values -- so a captured CUDA graph's launch shapes depend only on
what was fixed at capture time. Which kernel a launch takes, and the default configs, are the
route table's (``kernels/routes.py``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch

from mla_fuzz.mla_ref import ModelSpec

__all__ = ["DecodeConfig", "KERNEL_NAMES", "UNSPECIALIZED_DECODE_INTEGERS", "interpreting", "next_pow2",
           "check_spec_supported", "sm_count"]

#: integer arguments of every split-KV decode kernel that follow the batch rather than the model:
#: the block table's row stride (pages per sequence), the partial buffer's rows and the tokens
#: per request. Triton would compile a variant per class of each (equal to 1, a multiple of 16,
#: neither) and the classes multiply: a campaign that varies the batch met dozens of variants
#: after its warmup. They enter only scalar address arithmetic and bounds, so none is
#: specialised (``do_not_specialize``); the head count stays specialised: it is the model's.
UNSPECIALIZED_DECODE_INTEGERS = ("bt_stride", "partial_cap", "SQ")

#: the decode kernels a config can name (``DecodeConfig.kernel``; ``routes.KERNELS`` describes each)
KERNEL_NAMES = ("triton", "wgmma", "wgmma_pp", "wgmma_ws64", "wgmma_rs", "wgmma_ws", "wgmma_kt")


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


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (an H100's 132 on a machine without CUDA)."""
    try:
        return torch.cuda.get_device_properties(device).multi_processor_count
    except Exception:  # pragma: no cover - no CUDA
        return 132


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
    """Tile shapes, launch knobs and kernel of the split-KV decode.

    - ``block_m``: query rows per program; rows are (token, head) pairs of one request
      flattened token-major, so the MTP tokens fold into the M dimension with the heads.
    - ``block_n``: keys per inner-loop tile; also the planner's unit of work (a *tile*).
    - ``num_parts``: programs along the KV axis (a persistent grid): the planner cuts the
      batch's total tile count into at most ``num_parts`` equal contiguous ranges (the fewest
      that keep the longest at ``cdiv(total, num_parts)`` tiles; ``kernels/planner.py``); a
      request crossed by a cut is split, its pieces merged by the combine kernel.
    - ``min_tiles_per_part``: fewer parts are used when the batch is short, so a part
      gets at least this many tiles (combine work would dominate) -- except, above 2, a batch
      of short requests too small for half the parts, which gets parts of two tiles
      (``kernels/planner.py``).
    - ``num_warps`` / ``num_stages``: Triton's; ignored by the interpreter.
    - ``combine_block_m``: rows per combine program.
    - ``combine_col_blocks``: combine programs per row block, each merging ``rank /
      combine_col_blocks`` latent columns (must leave a power of two).
    - ``fp8_grouped``: FP8 caches on the Triton kernel only -- its grouped-dot path where the
      spec and row block allow it (else the dequantise path; ``kernels/decode_split.py``).
    - ``kernel``: the decode kernel (``KERNEL_NAMES``; ``routes.KERNELS``): ``"triton"``, the
      portable one, runs any config; a Hopper kernel runs the launches it is written for and
      hands the others down its fallback chain (``routes.resolve``).
    - ``reason``: why the route table chose this config (``routes.ROUTES``; not compared).
    """

    block_m: int = 16
    block_n: int = 64
    num_parts: int = 132
    min_tiles_per_part: int = 2
    num_warps: int = 4
    num_stages: int = 2
    combine_block_m: int = 16
    combine_col_blocks: int = 1
    fp8_grouped: bool = True
    kernel: str = "triton"
    reason: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "combine_block_m"):
            v = getattr(self, name)
            if not _is_pow2(v) or v < 16:
                raise ValueError(f"DecodeConfig.{name} must be a power of two >= 16, got {v}")
        for name in ("num_parts", "min_tiles_per_part", "num_warps", "num_stages", "combine_col_blocks"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"DecodeConfig.{name} must be a positive int, got {v!r}")
        if self.kernel not in KERNEL_NAMES:
            raise ValueError(f"DecodeConfig.kernel must be one of {KERNEL_NAMES}, got {self.kernel!r}")

    def with_(self, **kw) -> "DecodeConfig":
        """A copy with some fields replaced (and no ``reason`` unless given: the route's no longer holds)."""
        return replace(self, **{"reason": "", **kw})

    def m_blocks(self, s_q: int, num_heads: int) -> int:
        """Programs along the query-row axis for ``s_q`` tokens of ``num_heads`` heads."""
        return -(-(s_q * num_heads) // self.block_m)

    def partial_capacity(self) -> int:
        """Rows of the fp32 partial buffer: at most ``2 * (num_parts - 1)`` pieces of
        requests that are split (each split request holds >= 1 of the ``num_parts - 1``
        cuts and has one more piece than cuts), and never less than one row."""
        return max(2 * self.num_parts, 1)
