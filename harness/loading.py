"""Finding and constructing decode backends: ``triton``, ``mutant:NAME`` or ``pkg.mod:Class``."""
from __future__ import annotations

import importlib
import inspect
import os
import sys

import torch

from mla_fuzz.mla_ref import Capabilities, ModelSpec, capabilities_of

from .blame import defined_at

#: The constructor every backend is called with (``DecodeBackend``'s contract).
SIGNATURE = "__init__(self, spec, *, device, max_batch, capture_sizes, graph_safe, **extra)"
REQUIRED = ("device", "max_batch", "capture_sizes", "graph_safe")
EXTRAS = ("page_size", "max_blocks_per_seq", "next_n_max", "num_blocks", "topk_max", "indexer")


def load_backend(ref: str):
    """The backend class named by ``ref``.

    ``"triton"`` is ours; ``"mutant:NAME"`` (or a bare mutant name) one of
    ``harness.mutants.ALL`` or of the held-out set (``harness.mutants.heldout.HELDOUT``);
    otherwise ``package.module:Class``. ValueError with the reason on anything that cannot
    be loaded (never an ImportError traceback).
    """
    if not isinstance(ref, str) or not ref:
        raise ValueError(f"backend must be 'triton', 'mutant:NAME' or 'package.module:Class', got {ref!r}")
    if ref == "triton":
        from mla_fuzz.kernels import TritonMLABackend
        return TritonMLABackend
    if ref.startswith("mutant:") or ":" not in ref:
        # mutants are imported only when asked for: a user's backend must not depend on them
        from .mutants import ALL as MUTANTS
        from .mutants.heldout import HELDOUT
        name = ref.split(":", 1)[1] if ref.startswith("mutant:") else ref
        if name in MUTANTS:
            return MUTANTS[name]
        if name in HELDOUT:
            return HELDOUT[name]
        if ref.startswith("mutant:"):
            raise ValueError(f"unknown mutant {name!r}; known: {', '.join(sorted(MUTANTS))} "
                             f"(held out: {', '.join(sorted(HELDOUT))})")
        raise ValueError(f"backend {ref!r}: expected 'package.module:Class' (or 'triton', or a mutant name)")
    mod_name, _, attr = ref.partition(":")
    # As ``python -m`` and pytest do: a backend module in the working directory imports even
    # when the command itself was started from a console script.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
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
    check_constructor(obj, ref)
    try:
        capabilities_of(obj)
    except ValueError as exc:
        raise ValueError(f"backend {ref!r}: {exc}") from None
    return obj


def check_constructor(cls, ref: str | None = None) -> None:
    """ValueError (one line, naming the expected signature and the backend's file:line) when
    ``cls.__init__`` cannot be called the way the harness calls every backend."""
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return  # a builtin or C constructor: let the call itself speak
    params = list(sig.parameters.values())[1:]  # self
    kinds = inspect.Parameter
    takes_kw = any(p.kind is kinds.VAR_KEYWORD for p in params)
    positional = [p for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    takes_spec = bool(positional) or any(p.kind is kinds.VAR_POSITIONAL for p in params)
    names = {p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    missing = [k for k in REQUIRED if k not in names and not takes_kw]
    # parameters the harness would never pass: required ones beyond spec and the protocol's
    known = set(REQUIRED) | set(EXTRAS)
    unfilled = [p.name for p in positional[1:] + [p for p in params if p.kind is kinds.KEYWORD_ONLY]
                if p.default is p.empty and p.name not in known]
    if takes_spec and not missing and not unfilled:
        return
    site = defined_at(cls.__init__)
    where = f" ({site})" if site else ""
    what = (f"cannot take {', '.join(missing)}" if missing else
            f"needs {', '.join(unfilled)}, which the harness never passes" if unfilled else "takes no spec")
    raise ValueError(f"backend {ref or cls.__name__!r}: __init__{sig}{where} {what}; expected {SIGNATURE} "
                     f"(extras passed when named: {', '.join(EXTRAS)}; docs/backends.md#constructor)")


def is_ours(cls) -> bool:
    """Our Triton backend or one of its mutants (kernels that work around the interpreter)."""
    try:
        from mla_fuzz.kernels import TritonMLABackend
    except Exception:
        return False
    return isinstance(cls, type) and issubclass(cls, TritonMLABackend)


def effective_capabilities(cls, narrow: dict | None = None, cpu: bool = False) -> tuple[Capabilities, list[str]]:
    """What the fuzzer will draw for backend ``cls``: its declared ``capabilities``, narrowed
    by the user (``narrow``: ``Capabilities.narrow`` keywords), and on CPU (``cpu``) without
    bf16 for third-party backends when Triton's interpreter mis-computes it
    (``harness.interpreter``), unless the user asked for bf16 queries by name. Returns ``(caps, notes)``, notes being lines to show the user.
    ValueError (one line) when nothing is left to draw."""
    caps = capabilities_of(cls)
    notes = []
    if narrow:
        caps = caps.narrow(**narrow)
    asked_bf16 = "bf16" in ((narrow or {}).get("q_dtypes") or ())
    if cpu and not is_ours(cls) and not asked_bf16:
        from .interpreter import bf16_broken
        if "bf16" in caps.q_dtypes and bf16_broken():
            if caps.q_dtypes == ("bf16",):
                raise ValueError("this backend takes bf16 queries only, and on CPU Triton's interpreter mis-computes "
                                 "bf16 arithmetic (docs/backends.md#cpu): fuzz it with --graph cuda on a GPU, or "
                                 "declare fp16 in its capabilities")
            kv = tuple(k for k in caps.kv_dtypes if k != "bf16")
            caps = caps.narrow(q_dtypes=("fp16",), kv_dtypes=kv) if kv else caps
            if not kv:
                raise ValueError("this backend reads bf16 caches only, and on CPU Triton's interpreter mis-computes "
                                 "bf16 arithmetic (docs/backends.md#cpu): fuzz it with --graph cuda on a GPU")
            import triton
            notes.append(f"notice: Triton {triton.__version__}'s CPU interpreter mis-computes bf16 arithmetic, so "
                         f"this backend is fuzzed with fp16 only on CPU (docs/backends.md#cpu); a backend that runs "
                         f"no Triton kernel can ask for bf16 with --q-dtypes bf16,fp16")
    return caps, notes


def backend_name(cls) -> str:
    return getattr(cls, "name", None) or cls.__name__


def make_backend(cls, spec: ModelSpec, *, device, max_batch: int, capture_sizes: list[int], graph_safe: bool,
                 **extra):
    """Instantiate with the protocol's keywords plus whichever of ``extra`` (``EXTRAS``) the
    constructor accepts (all of them with ``**kwargs``)."""
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
