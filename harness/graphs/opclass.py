"""How the emulator treats each dispatched op: replay class and host-read rules.

Replay classes (``classify``):

- ``VIEW``: returns an alias of an input without writing (schema ``Tensor(a)`` return, e.g.
  ``view``, ``slice``, ``select``, ``t``, ``unbind``, ``detach``, ``lift_fresh``). Skipped on
  replay: the view object made at capture already aliases its base's storage, and views
  depend only on static metadata. Re-creating it would break aliasing downstream.
- ``META``: changes a tensor's metadata in place (``Tag.inplace_view``: ``t_``,
  ``transpose_``, ``resize_``, ``set_``, ``as_strided_``...). Skipped on replay; every
  recorded argument carries its own metadata snapshot, so ops recorded before and after the
  change each see the layout they saw at capture.
- ``ALLOC``: uninitialised allocation (``empty``, ``empty_like``, ``empty_strided``,
  ``new_empty``...). Not re-run: the tensor persists, as pool memory does on a GPU.
- ``EXEC``: everything else. Re-run on replay on the recorded tensor objects; results of
  non-mutating outputs are copied back into the tensors recorded as that op's outputs.

Host reads (``host_read_reason``): ops whose result a CUDA capture cannot produce without
synchronising with the host. They are decided by op, not by device, because on a CPU-only
emulation the "device" is the CPU.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

VIEW, META, ALLOC, EXEC = "view", "meta", "alloc", "exec"

# Namespaces whose ops are implemented in C++ below the dispatcher: their inner work never
# reaches a Python mode. Any other namespace (torch.library custom ops) may run Python.
BUILTIN_NAMESPACES = frozenset({"aten", "prims", "prim", "quantized", "_quantized", "rngprims"})

ALLOC_OPS = frozenset({
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
    "aten::new_empty_strided", "aten::empty_permuted",
})

# Ops that return a Python value read out of tensor memory.
HOST_VALUE_OPS = {
    "aten::_local_scalar_dense": "reads a tensor value on the host (.item(), int(), float(), bool())",
    "aten::item": "reads a tensor value on the host (.item())",
    "aten::is_nonzero": "reads a tensor value on the host (bool(tensor))",
    "aten::equal": "returns a Python bool computed from device data (torch.equal)",
    "aten::allclose": "returns a Python bool computed from device data (torch.allclose)",
}

# Ops whose output shape depends on tensor values: the host must wait for the count.
DATA_DEPENDENT_SHAPE_OPS = {
    "aten::nonzero": "output shape depends on data (nonzero / torch.where(cond))",
    "aten::nonzero_numpy": "output shape depends on data (nonzero)",
    "aten::argwhere": "output shape depends on data (argwhere)",
    "aten::masked_select": "output shape depends on data (masked_select)",
    "aten::_unique": "output shape depends on data (unique)",
    "aten::_unique2": "output shape depends on data (unique)",
    "aten::unique_dim": "output shape depends on data (unique)",
    "aten::unique_consecutive": "output shape depends on data (unique_consecutive)",
    "aten::unique_dim_consecutive": "output shape depends on data (unique_consecutive)",
    "aten::bincount": "output shape depends on data (bincount)",
}

# Non-tensor returns that are metadata, not data (no sync on a GPU).
METADATA_QUERIES = frozenset({
    "aten::is_same_size", "aten::is_pinned", "aten::is_coalesced", "aten::is_set_to",
    "aten::_nnz", "aten::dense_dim", "aten::sparse_dim", "aten::_dimI", "aten::_dimV",
    "aten::q_scale", "aten::q_zero_point", "aten::q_per_channel_axis", "aten::qscheme",
    "aten::_has_compatible_shallow_copy_type", "aten::is_strides_like_format",
    "aten::is_non_overlapping_and_dense",
})
_VALUE_RETURN_TYPES = frozenset({"number", "Scalar", "bool", "float", "complex"})

_INDEX_READ_OPS = frozenset({"aten::index", "aten::_unsafe_index"})
_INDEX_WRITE_OPS = frozenset({"aten::index_put_", "aten::index_put", "aten::_index_put_impl_",
                              "aten::_unsafe_index_put"})
# (dst argument or None for "the output", src argument)
_COPY_OPS = {
    "aten::copy_": ("self", "src"),
    "aten::copy": ("self", "src"),
    "aten::_to_copy": (None, "self"),
    "aten::_copy_from": ("dst", "self"),
    "aten::_copy_from_and_resize": ("dst", "self"),
}

# Python-level tensor methods that read memory without dispatching an op (a CPU tensor's
# ``tolist`` copies straight out of its buffer), caught with a TorchFunctionMode.
FUNCTION_HOST_READS = {
    "tolist": "Tensor.tolist() copies device memory to the host",
    "numpy": "Tensor.numpy() exposes device memory to the host",
    "__array__": "numpy conversion of a tensor copies device memory to the host",
}


@dataclass(frozen=True)
class OpInfo:
    """Static facts about one op overload (cached per overload)."""

    name: str          # "aten::mm", "mla_fuzz::decode"
    kind: str          # VIEW | META | ALLOC | EXEC
    mutable: bool      # writes at least one argument
    builtin: bool      # implemented below the dispatcher (no Python inside)
    value_return: bool  # returns a Python number/bool


@functools.lru_cache(maxsize=None)
def classify(func: torch._ops.OpOverload) -> OpInfo:
    """Replay class of ``func`` from its schema (alias annotations) and tags."""
    schema = func._schema
    name = schema.name
    mutable = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    builtin = name.split("::", 1)[0] in BUILTIN_NAMESPACES
    value_return = any(str(r.type) in _VALUE_RETURN_TYPES for r in schema.returns)
    if torch.Tag.inplace_view in func.tags:
        kind = META
    elif (not mutable and schema.returns
          and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)):
        kind = VIEW
    elif name in ALLOC_OPS:
        kind = ALLOC
    else:
        kind = EXEC
    return OpInfo(name, kind, mutable, builtin, value_return)


def arg(func: torch._ops.OpOverload, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    """The value bound to schema argument ``name`` in a dispatched call."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            if i < len(args) and not a.kwarg_only:
                return args[i]
            return kwargs.get(name, default)
    return default


def _is_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def host_read_reason(func: torch._ops.OpOverload, info: OpInfo, args: tuple, kwargs: dict,
                     is_dev: Callable[[torch.Tensor], bool]) -> Optional[str]:
    """Why this call would need a host synchronisation during a CUDA capture, or ``None``.

    ``is_dev(t)`` says whether ``t`` lives in the captured device's memory: a host read of
    a tensor outside it (a CPU tensor beside a CUDA capture) is legal and not graph work.
    """
    name = info.name
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    on_dev = any(is_dev(t) for t in tensors)

    if name in HOST_VALUE_OPS and on_dev:
        return HOST_VALUE_OPS[name]
    if name in DATA_DEPENDENT_SHAPE_OPS and on_dev:
        return DATA_DEPENDENT_SHAPE_OPS[name]
    if info.value_return and on_dev and name not in METADATA_QUERIES:
        return "returns a Python value computed from device data"

    if name == "aten::repeat_interleave":
        repeats = arg(func, args, kwargs, "repeats")
        if (isinstance(repeats, torch.Tensor) and is_dev(repeats)
                and arg(func, args, kwargs, "output_size") is None):
            return "output shape depends on data (repeat_interleave with tensor repeats, no output_size)"

    if name in _INDEX_READ_OPS:
        self = arg(func, args, kwargs, "self")
        indices = arg(func, args, kwargs, "indices") or ()
        if is_dev(self) and any(_is_mask(i) for i in indices):
            return "boolean-mask indexing: output shape depends on data (x[mask] calls nonzero)"

    if name in _INDEX_WRITE_OPS:
        self = arg(func, args, kwargs, "self")
        indices = list(arg(func, args, kwargs, "indices") or ())
        if is_dev(self) and any(_is_mask(i) for i in indices):
            value = arg(func, args, kwargs, "values")
            accumulate = bool(arg(func, args, kwargs, "accumulate", False))
            # PyTorch turns ``x[mask] = scalar`` into masked_fill_ (no nonzero, no sync) when
            # there is exactly one mask index on self's device and a 1-element CPU value.
            given = [i for i in indices if i is not None]
            fast = (not accumulate and isinstance(value, torch.Tensor) and value.numel() == 1
                    and value.device.type == "cpu" and len(given) == 1
                    and given[0].device == self.device)
            if not fast:
                return "boolean-mask index_put: expands the mask with nonzero (host sync)"

    if name in _COPY_OPS:
        dst_name, src_name = _COPY_OPS[name]
        src = arg(func, args, kwargs, src_name)
        if dst_name is None:
            dst_dev = arg(func, args, kwargs, "device") or (src.device if isinstance(src, torch.Tensor) else None)
            dst_dev = torch.device(dst_dev) if dst_dev is not None else None
        else:
            dst = arg(func, args, kwargs, dst_name)
            dst_dev = dst.device if isinstance(dst, torch.Tensor) else None
        if isinstance(src, torch.Tensor) and dst_dev is not None and src.device.type != dst_dev.type:
            non_blocking = bool(arg(func, args, kwargs, "non_blocking", False))
            if dst_dev.type == "cpu" and is_dev(src):
                return f"copies device memory to the host ({src.device} -> cpu, e.g. .cpu()/.to('cpu'))"
            if src.device.type == "cpu" and _device_is_dev(dst_dev, is_dev):
                if not (non_blocking and src.is_pinned()):
                    return (f"copies host memory to the device ({'non_blocking from pageable memory' if non_blocking else 'blocking'}"
                            f" cpu -> {dst_dev}); only non_blocking copies from pinned memory are capturable")
    return None


def _device_is_dev(device: torch.device, is_dev: Callable[[torch.Tensor], bool]) -> bool:
    # ``is_dev`` only looks at ``.device``; probe it without allocating a tensor.
    return is_dev(_DeviceProbe(device))


class _DeviceProbe:
    """Duck-typed object with a ``device`` attribute, for ``is_dev`` predicates."""

    __slots__ = ("device",)

    def __init__(self, device: torch.device):
        self.device = device
