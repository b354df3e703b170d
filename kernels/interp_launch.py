"""A shorter kernel launch for Triton's CPU interpreter when every argument is on the CPU.

Each interpreted launch (``GridExecutor.__call__``) costs about 1.5 ms before the first
op of the kernel runs, and an emulated fuzz step launches ~6 kernels (planner, decode,
combine, cache write, ...). Of that, three parts are pure overhead on the CPU:

- *host copies*: every tensor argument is re-made as a "host" tensor (``untyped_storage``,
  ``storage.cpu()``, ``new_empty``, ``set_``) and, after the grid, its storage copied back
  into the "device" one. On the CPU the two are the same storage; the kernel reads the
  same memory either way. Each of those tensor calls also passes through any torch
  function mode that is active -- under the fuzzer's emulated capture, the host-read
  guard, which logs ~20 of them per launch;
- *argument binding*: ``inspect.getfullargspec`` and ``inspect.getcallargs`` on every
  launch, for a function whose signature never changes;
- *language patching*: ``triton.language``'s ~200 builtins are swapped for interpreter
  versions before the grid and swapped back after it (``_patch_lang`` / ``restore``).

``install()`` replaces ``GridExecutor.__call__`` by a version that, when every tensor
argument (also inside tuples and tensor descriptors) is a plain CPU ``torch.Tensor``,
passes the arguments as they are, binds them with a signature read once per function,
and leaves ``triton.language`` patched after the launch (the next launch finds it patched
and skips the walk, as nested jit calls already do, ``config._skip_nested_repatching``).
In a process that interprets its kernels nothing else calls those builtins: outside a
kernel they only raise "must be called inside a jit function". Everything else is
Triton's own code path: pre-run hooks, ``_implicit_cvt``, the grid loop, the
``InterpreterError`` wrapping. Any other argument (a CUDA tensor, a ``reinterpret``
wrapper, a tensor subclass) takes Triton's original ``__call__``. Numerics cannot change
(the kernel sees the same pointers); ``tests/test_interpreter_speedups.py`` compares the
outputs bit for bit against the plain interpreter (``MLA_FUZZ_PLAIN_INTERPRETER=1``).
"""
from __future__ import annotations

import inspect

import torch

__all__ = ["install"]


def _plain_cpu(arg, descriptor_cls) -> bool:
    """True when ``arg`` needs no host copy: not a tensor-like, or a plain CPU tensor (also
    as every element of a tuple, or as a tensor descriptor's base)."""
    if type(arg) is torch.Tensor:
        return arg.device.type == "cpu"
    if isinstance(arg, tuple):
        return all(_plain_cpu(a, descriptor_cls) for a in arg)
    if descriptor_cls is not None and isinstance(arg, descriptor_cls):
        return _plain_cpu(arg.base, descriptor_cls)
    return not hasattr(arg, "data_ptr")


class _Signature:
    """What binding needs from a kernel's signature, read once."""

    __slots__ = ("positional", "accepted", "defaults", "constexprs")

    def __init__(self, fn, constexprs):
        spec = inspect.getfullargspec(fn)
        self.positional = tuple(spec.args)
        self.accepted = frozenset(spec.args) | frozenset(spec.kwonlyargs)
        self.defaults = dict(zip(spec.args[len(spec.args) - len(spec.defaults or ()):], spec.defaults or ()))
        self.defaults.update(spec.kwonlydefaults or {})
        self.constexprs = frozenset(constexprs)

    def bind(self, args, kwargs):
        """``{name: value}`` as ``inspect.getcallargs`` gives it, after dropping keywords the
        function does not take (launch options such as ``num_warps``); None when the call
        does not bind (Triton's own path then raises its error)."""
        if len(args) > len(self.positional):
            return None
        bound = dict(zip(self.positional, args))
        for k, v in kwargs.items():
            if k in self.accepted:
                if k in bound:
                    return None
                bound[k] = v
        for name in self.positional:
            if name not in bound:
                if name not in self.defaults:
                    return None
                bound[name] = self.defaults[name]
        for name, value in self.defaults.items():
            bound.setdefault(name, value)
        return bound


def install() -> None:
    """Install the CPU fast path on ``triton.runtime.interpreter.GridExecutor`` (module doc).
    Idempotent; a Triton whose interpreter is laid out differently keeps its own launch."""
    try:
        import triton
        from triton.runtime import interpreter as _interp
        try:
            from triton.tools.tensor_descriptor import TensorDescriptor
        except Exception:  # pragma: no cover - an older Triton
            TensorDescriptor = None
        executor = _interp.GridExecutor
        original = executor.__call__
        if getattr(original, "_mla_fuzz", False):
            return
        implicit_cvt, builder = _interp._implicit_cvt, _interp.interpreter_builder
        interpreter_error = _interp.InterpreterError
        signatures: dict = {}

        def call(self, *args_dev, **kwargs):
            if not (all(_plain_cpu(a, TensorDescriptor) for a in args_dev)
                    and all(_plain_cpu(v, TensorDescriptor) for v in kwargs.values())):
                return original(self, *args_dev, **kwargs)
            sig = signatures.get(self.fn)
            if sig is None:
                constexprs = getattr(self, "constexprs", None)
                if constexprs is None:  # pragma: no cover - another Triton's executor
                    return original(self, *args_dev, **kwargs)
                sig = signatures[self.fn] = _Signature(self.fn, constexprs)
            bound = sig.bind(args_dev, kwargs)
            if bound is None:
                return original(self, *args_dev, **kwargs)
            for hook in self.pre_run_hooks:
                hook(*args_dev, **{k: v for k, v in kwargs.items() if k in sig.accepted})
            # patched for good: the scope is not restored (module doc)
            _interp._patch_lang(self.fn)
            args = {name: arg if name in sig.constexprs else implicit_cvt(arg) for name, arg in bound.items()}
            grid = self.grid(args) if callable(self.grid) else self.grid
            assert len(grid) <= 3, "grid must have at most 3 dimensions"
            grid = tuple(grid) + (1,) * (3 - len(grid))
            builder.set_grid_dim(*grid)
            try:
                for x in range(grid[0]):
                    for y in range(grid[1]):
                        for z in range(grid[2]):
                            builder.set_grid_idx(x, y, z)
                            self.fn(**args)
            except Exception as e:
                if triton.knobs.compilation.front_end_debugging:
                    raise
                raise interpreter_error(repr(e)) from e

        call._mla_fuzz = True
        executor.__call__ = call
    except Exception:  # pragma: no cover - another Triton layout: keep its launch
        pass
