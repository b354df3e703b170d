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

__all__ = ["DecodeConfig", "interpreting", "default_config", "next_pow2", "check_spec_supported",
           "interpreter_release_semantics"]


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``).

    Read at every launch rather than cached, because the test-suite sets the variable in
    conftest before the first launch and a cached value would be taken too early.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_INTERPRETER_RELAXED = False


def interpreter_release_semantics() -> None:
    """Make Triton's interpreter check integer overflow as a GPU release build does (not at
    all), and skip its redundant re-patching on nested jit calls (``_skip_nested_repatching``).

    The interpreter runs with ``sanitize_overflow`` on and *executes* the check it implies
    on every int32 ``+``/``-``/``*`` (an int64 recomputation, two comparisons and a device
    assert): about 30% of an interpreted decode was spent there. A compiled kernel drops
    those asserts unless built with ``debug=True``, so turning the option off makes the CPU
    run the same integer semantics as the GPU, faster. Touches a private interpreter
    object; if a Triton version lays it out differently this is a no-op.
    """
    global _INTERPRETER_RELAXED
    if _INTERPRETER_RELAXED:
        return
    _INTERPRETER_RELAXED = True
    try:
        import dataclasses

        from triton.runtime import interpreter as _interp
        builder = _interp.interpreter_builder
        if getattr(builder.options, "sanitize_overflow", False):
            builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    except Exception:  # pragma: no cover - another Triton layout: keep its defaults
        pass
    _skip_nested_repatching()


def _skip_nested_repatching() -> None:
    """Every call of a nested ``@triton.jit`` function under the interpreter — ``to_out``,
    and the combine functions behind ``tl.sum``/``tl.max``/``tl.cumsum`` — re-runs
    ``_patch_lang``, which walks all of ``triton.language`` (``inspect.getmembers``) to
    patch builtins that the enclosing launch has already patched: 2-3 ms per call, a
    quarter of an interpreted fuzz step. When every language module the function sees is
    already patched (its ``load`` is no longer the builtin) the walk is skipped; a launch's
    own patching and restoring are unchanged."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as _interp
        original = _interp._patch_lang
        if getattr(original, "_mla_fuzz", False):
            return

        def patch_lang(fn):
            # the language modules this function sees (``tl``; ``core`` for the library's
            # own helpers): skip only when each is already patched
            langs = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
            if langs and not any(tl.core.is_builtin(getattr(m, "load", None)) for m in langs):
                return _interp._LangPatchScope()
            return original(fn)

        patch_lang._mla_fuzz = True
        _interp._patch_lang = patch_lang
    except Exception:  # pragma: no cover - another Triton layout: keep its behaviour
        pass


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
    - ``fp8_grouped``: FP8 caches only — take the grouped-dot path of ``decode_split`` where
      the spec and row block allow it (else the dequantise path); which one is faster
      depends on the shape (``default_config``).
    """

    block_m: int = 16
    block_n: int = 64
    num_parts: int = 132
    min_tiles_per_part: int = 2
    num_warps: int = 4
    num_stages: int = 2
    combine_block_m: int = 16
    fp8_prefetch: bool = False
    fp8_grouped: bool = True

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

    On CPU (interpreter) the tiles are large (one row block per request, 32 keys) and the
    parts few (an odd count, so cuts fall inside requests and splits get exercised).
    On CUDA the values are the best of the sweeps recorded in ``benchmarks/results`` (H200,
    Triton 3.6): the row block follows the query rows per request (heads x MTP tokens) —
    16/32 rows for the memory-bound small-head case, 64 rows to feed the tensor cores when
    there are many heads; one persistent program per SM (``num_parts * m_blocks = SMs``)
    beat two per SM in every swept case; FP8 caches take the dequantise path with a
    register prefetch at 16 rows and the grouped-dot path with a prefetch at 32 (1.4-1.5x
    there); 64-row blocks always dequantise (``decode_split.GROUPED_MAX_BLOCK_M``).

    ``sparse``: the sparse top-k decode, whose unit is one (request, token) row (pass
    ``s_q=1``); on CPU its key tile is 32 wide — each tile is one interpreted loop trip, and
    the fuzzer's top-k of up to 64 still spans two tiles, so splits are exercised.
    """
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        # Interpreted cost is per executed op, almost independent of tile size, so CPU tiles
        # are as large as coverage allows: every query row of a request in one row block,
        # 32-key tiles (measured ~1.5x faster per forward than 16x16 on the fuzzer's tiny
        # batches) — still several tiles per request at page sizes >= 16, so cuts inside
        # requests (split-KV + combine) stay common.
        rows = s_q * spec.num_heads
        block_m = min(max(next_pow2(rows), 16), 64)
        return DecodeConfig(block_m=block_m, block_n=32, num_parts=5, min_tiles_per_part=1,
                            num_warps=4, num_stages=1, combine_block_m=block_m)
    rows = s_q * spec.num_heads
    prefetch = False
    grouped = True
    if rows <= 16:
        # FP8: the dequantise path with a register prefetch; the grouped-dot path was no
        # faster here (H200: within +-5%, H100: 6% slower at B=128, L=16k; see
        # benchmarks/results/h200-2026-11-26-fp8-decode.json, h100-2026-11-26-kernel.json)
        block_m, block_n, warps, stages = (16, 64, 8, 1) if fp8 else (16, 128, 8, 2)
        prefetch, grouped = fp8, False
    elif rows <= 32:
        # FP8: grouped dots + register prefetch, 1.4-1.5x the former default at s_q=2
        # (benchmarks/results/h200-2026-11-26-fp8-decode.json)
        block_m, block_n, warps, stages = (32, 64, 8, 1) if fp8 else (32, 64, 8, 2)
        prefetch = fp8
    else:
        block_m, block_n, warps, stages = 64, 64, 8, 2
    m_blocks = -(-rows // block_m)
    parts = max(1, _sm_count(device) // m_blocks)
    return DecodeConfig(block_m=block_m, block_n=block_n, num_parts=parts, min_tiles_per_part=2,
                        num_warps=warps, num_stages=stages, combine_block_m=16, fp8_prefetch=prefetch,
                        fp8_grouped=grouped)
