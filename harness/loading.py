"""Finding and constructing decode backends: ``triton``, ``mutant:NAME`` or ``pkg.mod:Class``."""
from __future__ import annotations

import importlib
import inspect

import torch

from mla_fuzz.mla_ref import ModelSpec


def load_backend(ref: str):
    """The backend class named by ``ref``.

    ``"triton"`` is ours; ``"mutant:NAME"`` (or a bare mutant name) one of
    ``harness.mutants.ALL``; otherwise ``package.module:Class``. ValueError with the
    reason on anything that cannot be loaded (never an ImportError traceback).
    """
    if not isinstance(ref, str) or not ref:
        raise ValueError(f"backend must be 'triton', 'mutant:NAME' or 'package.module:Class', got {ref!r}")
    if ref == "triton":
        from mla_fuzz.kernels import TritonMLABackend
        return TritonMLABackend
    if ref.startswith("mutant:") or ":" not in ref:
        # mutants are imported only when asked for: a user's backend must not depend on them
        from .mutants import ALL as MUTANTS
        name = ref.split(":", 1)[1] if ref.startswith("mutant:") else ref
        if name in MUTANTS:
            return MUTANTS[name]
        if ref.startswith("mutant:"):
            raise ValueError(f"unknown mutant {name!r}; known: {', '.join(sorted(MUTANTS))}")
        raise ValueError(f"backend {ref!r}: expected 'package.module:Class' (or 'triton', or a mutant name)")
    mod_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(mod_name)
    except Exception as exc:  # a user's module may fail in any way while importing
        raise ValueError(f"backend {ref!r}: cannot import module {mod_name!r}: {type(exc).__name__}: {exc}") from exc
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"backend {ref!r}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not inspect.isclass(obj):
        raise ValueError(f"backend {ref!r} is not a class")
    missing = [m for m in ("build", "forward") if not callable(getattr(obj, m, None))]
    if missing:
        raise ValueError(f"backend {ref!r} lacks the protocol method(s) {missing} (see DecodeBackend)")
    return obj


def backend_name(cls) -> str:
    return getattr(cls, "name", None) or cls.__name__


def make_backend(cls, spec: ModelSpec, *, device, max_batch: int, capture_sizes: list[int], graph_safe: bool,
                 **extra):
    """Instantiate with the protocol's keywords plus whichever of ``extra`` (page_size,
    max_blocks_per_seq, next_n_max, ...) the constructor accepts."""
    params = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = dict(device=torch.device(device), max_batch=max_batch, capture_sizes=list(capture_sizes),
                  graph_safe=graph_safe)
    kwargs.update({k: v for k, v in extra.items() if takes_any or k in params})
    return cls(spec, **kwargs)


def supports_layer(cls) -> bool:
    """Layer-level scenarios need a cache write by slot mapping (``write_kv``)."""
    return callable(getattr(cls, "write_kv", None))


def supports_sparse(cls) -> bool:
    """Sparse scenarios need a backend constructed with ``topk_max`` (sizing its index buffers)."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False
    return "topk_max" in params
