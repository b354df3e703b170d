"""A passive dispatch-level op log for real CUDA captures.

CUDA exposes no op names for a captured graph, but every op the capture records passes
through the dispatcher first, so a ``TorchDispatchMode`` that only writes names down gives
``graph.ops`` in the same vocabulary as the emulator (``"aten::mm"``, ``"mla_fuzz::plan"``).
Custom ops appear once: PyTorch pops the mode while an op's implementation runs.

It also holds a reference to every *pre-existing* device tensor the captured ops touch.
A CUDA graph keeps raw addresses only; if Python drops a captured input (the builder
rebinds its attribute to a fresh tensor), the caching allocator may hand that memory to
the next allocation and replay would read whatever lands there. Keeping those tensors
alive makes such a stale read deterministic (it reads the capture-time tensor, as the
emulator does), which is what the fuzzer's "replay matches the capture-time metadata"
diagnosis needs. Tensors allocated during the capture are left to the graph's pool.
"""
from __future__ import annotations

from typing import Dict, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class CudaOpLog(TorchDispatchMode):
    """Records op names touching ``device_type`` tensors; keeps pre-existing ones alive.

    After the capture: ``names`` (list of str) and ``kept`` (storage id -> storage). The
    storage, not the tensor object, is kept: ``x.set_(other)`` after capture must not free
    the memory the graph still points at."""

    def __init__(self, device_type: str = "cuda"):
        super().__init__()
        self.device_type = device_type
        self.names: List[str] = []
        self.kept: Dict[int, torch.UntypedStorage] = {}
        self._produced = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        dt = self.device_type
        if any(t.device.type == dt for t in ins) or any(t.device.type == dt for t in outs):
            self.names.append(func._schema.name)
            for t in ins:
                if t.device.type == dt and t not in self._produced:
                    st = t.untyped_storage()
                    self.kept.setdefault(st._cdata, st)
            for t in outs:
                if t.untyped_storage()._cdata not in self.kept:
                    self._produced[t] = True
        return out
