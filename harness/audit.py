"""Dispatch-level audits: which ops a forward runs, and what tensors its kernels get.

An ``OpAudit`` is a ``TorchDispatchMode`` that only *observes*: it logs every op name
and, for ops outside ``aten``/``prim`` (custom kernels such as ``mla_fuzz::decode`` or a
user's FlashMLA wrapper), the data pointer, shape, strides and contiguity of every tensor
argument; for builtin ops, the data pointers of their tensor arguments. That log is the
evidence behind three oracles and their diagnoses:

- address audit (oracle 4): which tensors a captured graph actually reads, through a custom
  kernel or a plain torch op (a metadata tensor clamped or cast before the kernel sees it);
- contiguity audit (oracle 5): a kernel handed a non-contiguous view (vLLM #42135), or
  ``as_strided`` applied to one: it addresses the view's storage with strides of its own,
  ignoring the view's, i.e. it reads the view flat exactly as a kernel would (a backend
  that re-reads a metadata view with device-side strides, as the sparse path's
  per-token context lengths do);
- laziness diagnosis: the planner op missing from the capture's op list (vLLM #42444).

It works under real CUDA graph capture and under the emulator alike, because it sits
above them in the mode stack and passes every op straight through.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_BUILTIN_NAMESPACES = ("aten", "prim", "prims", "_c10d_functional", "profiler")
# builtin ops that read their input's storage flat, as a kernel does
_FLAT_READS = ("aten::as_strided",)


@dataclass
class KernelCall:
    """One custom-op call: its name and, per tensor argument, (index, ptr, shape, stride,
    contiguous, storage ptr)."""

    op: str
    tensors: list[tuple[int, int, tuple, tuple, bool, int]]


@dataclass
class OpLog:
    ops: list[str] = field(default_factory=list)
    kernels: list[KernelCall] = field(default_factory=list)
    # builtin flat reads (``_FLAT_READS``) of non-contiguous tensors: op, shape, strides, storage ptr
    flat_reads: list[tuple[str, tuple, tuple, int]] = field(default_factory=list)
    # data pointers of every tensor a builtin (aten) op was handed
    builtin_ptrs: set = field(default_factory=set)

    @property
    def custom_ops(self) -> list[str]:
        return [k.op for k in self.kernels]

    def read_ptrs(self) -> set[int]:
        """Data pointers of every tensor handed to a custom kernel or to a builtin op."""
        return {t[1] for k in self.kernels for t in k.tensors} | self.builtin_ptrs

    def noncontiguous(self, storages: set[int] | None = None) -> list[str]:
        """Human-readable list of non-contiguous tensors handed to custom kernels or read
        flat by a builtin (``as_strided``); with ``storages``, only views of those storages
        (the metadata's)."""
        out = []
        for k in self.kernels:
            for idx, _ptr, shape, stride, contig, storage in k.tensors:
                if not contig and (storages is None or storage in storages):
                    out.append(f"{k.op} argument #{idx}: shape {list(shape)} strides {list(stride)}")
        for op, shape, stride, storage in self.flat_reads:
            if storages is None or storage in storages:
                out.append(f"{op} (reads its input flat) of a view with shape {list(shape)} strides {list(stride)}")
        return out


def op_name(func) -> str:
    """``namespace::name`` of an OpOverload (``aten::mm``, ``mla_fuzz::decode``)."""
    try:
        return func._schema.name
    except AttributeError:
        return str(func)


class OpAudit(TorchDispatchMode):
    """Observe-only dispatch mode filling an ``OpLog``; see the module docstring."""

    def __init__(self, log: OpLog | None = None):
        super().__init__()
        self.log = log if log is not None else OpLog()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        self.log.ops.append(name)
        if name.split("::")[0] not in _BUILTIN_NAMESPACES:
            flat, _ = tree_flatten((args, kwargs))
            tensors = [
                (i, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.is_contiguous(), _storage(t))
                for i, t in enumerate(flat) if isinstance(t, torch.Tensor)
            ]
            self.log.kernels.append(KernelCall(name, tensors))
        else:
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor):
                    self.log.builtin_ptrs.add(_ptr(t))
            if name in _FLAT_READS and args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
                self.log.flat_reads.append((name, tuple(args[0].shape), tuple(args[0].stride()), _storage(args[0])))
        return func(*args, **kwargs)


def _ptr(t: torch.Tensor) -> int:
    try:
        return t.data_ptr()
    except Exception:  # tensors without storage (fake, functional wrappers)
        return -1


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # tensors without storage (fake, functional wrappers)
        return -1


def tensor_fields(obj, prefix: str = "", depth: int = 0, seen: set | None = None) -> dict[str, torch.Tensor]:
    """Every tensor reachable from a metadata object, keyed by attribute path.

    Walks dataclasses, plain objects' ``__dict__``, dicts, lists and tuples (depth <= 4),
    so the address audit works on any backend's metadata without a protocol method.
    """
    seen = set() if seen is None else seen
    found: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        found[prefix or "<metadata>"] = obj
        return found
    if depth > 4 or id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return found
    seen.add(id(obj))
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif hasattr(obj, "__dict__"):
        items = vars(obj).items()
    elif hasattr(obj, "__slots__"):
        items = ((s, getattr(obj, s, None)) for s in obj.__slots__)
    else:
        return found
    for key, value in items:
        path = f"{prefix}.{key}" if prefix else str(key)
        found.update(tensor_fields(value, path, depth + 1, seen))
    return found
