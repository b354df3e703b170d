"""Speed-ups of Triton's CPU interpreter (``TRITON_INTERPRET=1``) for the kernels' CPU runs.

Installed explicitly, once per process, by whatever runs the kernels interpreted: the test
suite (``tests/conftest.py``) and the fuzzer's worker processes. Nothing in ``kernels`` installs
them as a side effect; without them the kernels give the same results, slower. ``install()``:

- *overflow checks as a GPU release build*: the interpreter runs with ``sanitize_overflow``
  and executes the int64 recomputation and asserts it implies on every int32 ``+ - *``
  (about 30% of an interpreted decode); a compiled kernel drops them unless built with
  ``debug=True``, so turning the option off gives the CPU the GPU's integer semantics;
- *no re-patching on nested jit calls*: each call of a nested ``@triton.jit`` function
  (``to_out``, the combine functions of ``tl.sum`` / ``tl.max``) re-runs ``_patch_lang``,
  a walk of all of ``triton.language`` (2-3 ms); skipped when the language modules the
  function sees are already patched;
- *cached type bookkeeping* (``_cache_interpreter_types``): the per-op Python objects that
  describe a result, scalar splats, float conversion tables, the builtins of each package;
- *CPU launch* (``_install_cpu_launch``): a launch whose tensor arguments are all plain CPU
  tensors skips the host copies (host and device are one storage), binds its arguments with
  a signature read once, and leaves ``triton.language`` patched after the grid.

``MLA_FUZZ_PLAIN_INTERPRETER=1`` (before ``install()``) makes ``install()`` patch nothing:
Triton's interpreter as shipped, to rule the patches out when chasing an odd result, or to run
on a Triton they are not written for; ``tests/kernels/test_interpreter_speedups.py`` runs scenarios both
ways and compares every output bit for bit.

Each patch replaces private attributes of ``triton.runtime.interpreter`` and
``triton.language``. They are written for, and checked on, the Triton versions of
``TRITON_VERSIONS`` (on Triton 3.6 seven of the interpreter tests fail with them installed):
``install()`` raises ``RuntimeError`` naming the installed version on any other, before patching
anything, and on a listed version whose interpreter lacks an attribute a patch replaces.
"""
from __future__ import annotations

import inspect
import os

import torch

__all__ = ["install", "installed", "PLAIN_INTERPRETER_ENV", "TRITON_VERSIONS"]

#: ``major.minor`` releases of Triton whose interpreter these patches are written for and checked on
TRITON_VERSIONS = ((3, 9),)
#: set to 1 (before ``install()``) to patch nothing: Triton's interpreter as shipped
PLAIN_INTERPRETER_ENV = "MLA_FUZZ_PLAIN_INTERPRETER"

_INSTALLED = False


def _plain() -> bool:
    return os.environ.get(PLAIN_INTERPRETER_ENV, "0") not in ("", "0")


def triton_version() -> tuple:
    """The installed Triton's ``(major, minor)``."""
    import triton
    parts = triton.__version__.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):  # pragma: no cover - an unparsable version string
        return (0, 0)


def _version_error(version: tuple) -> RuntimeError:
    import triton
    known = ", ".join(f"{a}.{b}" for a, b in TRITON_VERSIONS)
    return RuntimeError(
        f"mla_fuzz.kernels.interpreter_patches: Triton {triton.__version__} is installed, but these patches of "
        f"its interpreter's private attributes are written for Triton {known}. Run the interpreter unpatched "
        f"(set {PLAIN_INTERPRETER_ENV}=1, or do not call install(); same results, about twice as slow) or check "
        f"the patches against this version and add it to TRITON_VERSIONS.")


def _layout_error(what: str, error: BaseException) -> RuntimeError:
    import triton
    return RuntimeError(
        f"mla_fuzz.kernels.interpreter_patches: Triton {triton.__version__}'s interpreter has no {what} as the "
        f"patches expect ({type(error).__name__}: {error}). Run the interpreter unpatched (set "
        f"{PLAIN_INTERPRETER_ENV}=1, or do not call install()) or fix the patch.")


def install() -> None:
    """Install the speed-ups (module doc) into this process's Triton interpreter; nothing with
    ``MLA_FUZZ_PLAIN_INTERPRETER=1``. Idempotent. Raises ``RuntimeError`` on a Triton version not
    in ``TRITON_VERSIONS`` (before patching anything) or one whose interpreter lacks an attribute
    a patch replaces."""
    global _INSTALLED
    if _INSTALLED or _plain():
        return
    version = triton_version()
    if version not in TRITON_VERSIONS:
        raise _version_error(version)
    _relax_overflow()
    _skip_nested_repatching()
    _cache_interpreter_types()
    _install_cpu_launch()
    _INSTALLED = True


def installed() -> bool:
    """Whether ``install()`` has run in this process."""
    return _INSTALLED


def _relax_overflow() -> None:
    """``sanitize_overflow`` off in the interpreter's options (module doc)."""
    import dataclasses

    try:
        from triton.runtime import interpreter as _interp
        builder = _interp.interpreter_builder
        options = builder.options
        if getattr(options, "sanitize_overflow", False):
            builder.options = dataclasses.replace(options, sanitize_overflow=False)
    except (AttributeError, ImportError, TypeError) as e:  # pragma: no cover - a Triton laid out otherwise
        raise _layout_error("interpreter_builder.options", e) from e


def _skip_nested_repatching() -> None:
    """Nested ``@triton.jit`` calls skip ``_patch_lang``'s walk of ``triton.language`` when every
    language module the function sees (``tl``; ``core`` for the library's own helpers) is
    already patched (its ``load`` is no longer the builtin); a launch's own patching and
    restoring are unchanged."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as _interp
        original = _interp._patch_lang
        scope = _interp._LangPatchScope
        is_builtin = tl.core.is_builtin
    except (AttributeError, ImportError) as e:  # pragma: no cover - a Triton laid out otherwise
        raise _layout_error("_patch_lang / _LangPatchScope", e) from e
    if getattr(original, "_mla_fuzz", False):
        return

    def patch_lang(fn):
        langs = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
        if langs and not any(is_builtin(getattr(m, "load", None)) for m in langs):
            return scope()
        return original(fn)

    patch_lang._mla_fuzz = True
    _interp._patch_lang = patch_lang


def _cache_interpreter_types() -> None:
    """Cache the type bookkeeping the interpreter redoes for every op it executes.

    An interpreted op on the fuzzer's tiny tiles spends ~1-3% of its time in numpy and the
    rest in Python objects that describe the result: a ``block_type`` (shape re-validated,
    a ``tl.tuple`` and its ``tuple_type`` rebuilt, the name formatted), the ``tensor``
    wrapping it (one ``constexpr`` per dim and for numel, another ``tl.tuple``), the numpy
    dtype looked up in a dict rebuilt on each call (``_get_np_dtype``), ``_unwrap_if_constexpr``
    on every argument, dtype equality and ``is_int`` (a list concatenation per call), the
    implicit-cast and broadcast checks of two operands of one dtype and shape (a
    ``tl.tuple`` compared with a list through ``constexpr`` equality), the ``@builtin``
    wrapper between each patched builtin and its function, and after each launch a copy of
    every argument's storage onto itself (host and device are one storage on CPU). Those
    were about half of an interpreted fuzz step (cProfile, tiny spec). Then (a second
    profile, ~25 us an op left): operations between a tensor and a Python int/float (the
    scalar's type, promotion and splat redone each time), real broadcasts and
    ``x[:, None]`` (Triton's generic loops), float conversions from bf16/fp8 (~150 us of
    numpy bit arithmetic a call, also for every ``other=0.0`` of a bf16 load) and the
    ``inspect.getmembers`` walk of ``triton.language`` at every launch (~1.5 ms).

    Each is replaced by a version that caches what depends only on the shape or dtype name
    and builds equal objects: a fresh ``tl.tuple`` per object (it can be mutated), only the
    immutable leaves (``constexpr`` dims, ``tuple_type``) shared; or that takes a shortcut
    whose result Triton's rules fix (equal dtypes: no cast; equal shapes: no broadcast; the
    computation type of two dtypes); or that computes a value once and reuses it: the
    splat of a scalar over a block (one read-only array per value, dtype and shape, as
    read-only as the views ``np.broadcast_to`` already hands the interpreter's ops),
    conversion tables of Triton's own ``_convert_float`` over every code of a <= 16-bit
    type, the builtins of each language package. Anything off the fast path (a non-int
    dim, another rank, an unknown class) goes to Triton's own code, so errors are Triton's.
    Numerics are untouched: the same numpy operations run (or their results are reused),
    minus identity broadcasts and self-copies, and ``tests/kernels/test_interpreter_speedups.py``
    checks forwards and a kernel of odd operands bit for bit against the plain interpreter.
    """
    try:
        import builtins

        import numpy as np
        import triton.language.core as core
        from triton import _utils
        from triton.runtime import interpreter as _interp

        if getattr(core.block_type.__init__, "_mla_fuzz", False):
            return
        constexpr, tl_tuple, block_type, tensor = core.constexpr, core.tuple, core.block_type, core.tensor
        pointer_type, dtype_cls = core.pointer_type, core.dtype
        new_tuple = tl_tuple.__new__

        # -- _get_np_dtype: its result depends on the dtype's name only (the table's keys
        # compare by name); pointers (and blocks of them) are uint64
        orig_np_dtype = _interp._get_np_dtype
        np_by_name: dict = {}
        u64 = np.dtype(np.uint64)

        def get_np_dtype(tt):
            cls = type(tt)
            if cls is block_type:
                tt = tt.element_ty
                cls = type(tt)
            if cls is pointer_type:
                return u64
            if cls is dtype_cls:
                r = np_by_name.get(tt.name)
                if r is None:
                    r = np_by_name[tt.name] = orig_np_dtype(tt)
                return r
            return orig_np_dtype(tt)

        # -- _unwrap_if_constexpr: the classes it returns unchanged, decided by exact type
        orig_unwrap = core._unwrap_if_constexpr
        passthrough = frozenset({int, float, bool, str, type(None), tensor, dtype_cls, block_type, pointer_type})

        def unwrap_if_constexpr(o):
            cls = type(o)
            if cls is constexpr:
                return o.value
            if cls in passthrough:
                return o
            return orig_unwrap(o)

        def fresh_tuple(values, ttype):
            t = new_tuple(tl_tuple)
            t.values = list(values)
            t.type = ttype
            return t

        def int_key(values):
            for d in values:
                if type(d) is not int:
                    return None
            return builtins.tuple(values)

        # What a tensor of a given shape holds: numel and one constexpr per dim (shared,
        # immutable) and the tuple type of those dims. Stashed on each block type built
        # below (``_mla_t``), so a tensor of that type finds it with one attribute read;
        # scalar types take the class default, the entry of shape ().
        tensor_shapes: dict = {}

        def tensor_entry(key):
            ent = tensor_shapes.get(key)
            if ent is None:
                dims = [constexpr(s) for s in key]
                ent = tensor_shapes[key] = (constexpr(_prod(key)), dims, core._type_for_tuple_values(dims))
            return ent

        # -- block_type(element_ty, shape): shape checks, tuple type and text per shape
        orig_block_init = block_type.__init__
        block_shapes: dict = {}

        def block_init(self, element_ty, shape):
            cls = type(shape)
            key = int_key(shape if cls is list else shape.values) if cls is list or cls is tl_tuple else None
            ent = block_shapes.get(key) if key else None
            if ent is None:
                if not key:  # not a non-empty list of ints: Triton's path (and its errors)
                    return orig_block_init(self, element_ty, shape)
                numel = _utils.validate_block_shape(key)
                ttype = core._type_for_tuple_values(list(key))
                ent = block_shapes[key] = (numel, ttype, str(fresh_tuple(key, ttype)), tensor_entry(key))
            numel, ttype, text, self._mla_t = ent
            self.element_ty = element_ty
            t = new_tuple(tl_tuple)
            t.values = list(key)
            t.type = ttype
            self.shape = t
            self.numel = numel
            self.name = f'<{text}, {element_ty}>'

        # -- tensor(handle, type)
        orig_tensor_init = tensor.__init__

        def tensor_init(self, handle, type):
            ent = type._mla_t
            if ent is None:  # a block type built by Triton's own __init__ (or another class)
                shape = type.shape if type.is_block() else ()
                key = () if shape == () else (int_key(shape.values) if builtins.type(shape) is tl_tuple else None)
                if key is None:
                    return orig_tensor_init(self, handle, type)
                ent = tensor_entry(key)
            numel, dims, ttype = ent
            self.handle = handle
            self.numel = numel
            self.type = type
            self.dtype = type.scalar
            t = new_tuple(tl_tuple)
            t.values = list(dims)
            t.type = ttype
            self.shape = t

        # -- dtype equality and is_int: by name, as Triton's (which unwraps a constexpr
        # first, and rebuilds a list of the integer type names on every is_int call)
        orig_dtype_eq = dtype_cls.__eq__
        int_names = frozenset(dtype_cls.SINT_TYPES + dtype_cls.UINT_TYPES)
        dtype_classes = frozenset({dtype_cls, block_type, pointer_type})

        def dtype_eq(self, other):
            if type(other) in dtype_classes:
                return self.name == other.name
            return orig_dtype_eq(self, other)

        def dtype_is_int(self):
            return self.name in int_names

        # -- broadcasting two blocks of one shape is the identity (Triton's check compares
        # a tl.tuple with a list through constexpr equality before concluding so)
        from triton.language.semantic import TritonSemantic
        orig_broadcast = TritonSemantic.broadcast_impl_value

        #    Blocks of equal rank and int dims whose shapes differ (``a[:, None] * b[None, :]``)
        #    and a block with a scalar take Triton's steps without its generic loops: the
        #    same result shape (a mismatch goes to Triton's code for its error), the same
        #    block types, the same builder calls (``create_broadcast`` / ``create_splat``).
        def broadcast_impl_value(self, lhs, rhs):
            lt, rt = lhs.type, rhs.type
            lc, rc = type(lt), type(rt)
            if lc is block_type:
                ls = lt.shape
                if rc is block_type:
                    rs = rt.shape
                    if type(ls) is tl_tuple and type(rs) is tl_tuple:
                        lv, rv = ls.values, rs.values
                        if lv == rv:
                            return lhs, rhs
                        ret = broadcast_shape(lv, rv)
                        if ret is not None:
                            builder = self.builder
                            if lv != ret:
                                lhs = tensor(builder.create_broadcast(lhs.handle, ret), block_type(lt.element_ty, ret))
                            if rv != ret:
                                rhs = tensor(builder.create_broadcast(rhs.handle, ret), block_type(rt.element_ty, ret))
                            return lhs, rhs
                elif rc in scalar_types and type(ls) is tl_tuple:
                    ty = block_type(rt, ls.values)
                    return lhs, tensor(self.builder.create_splat(ty, rhs.handle), ty)
            elif lc in scalar_types and rc is block_type:
                rs = rt.shape
                if type(rs) is tl_tuple:
                    ty = block_type(lt, rs.values)
                    return tensor(self.builder.create_splat(ty, lhs.handle), ty), rhs
            return orig_broadcast(self, lhs, rhs)

        scalar_types = frozenset({dtype_cls, pointer_type})

        def broadcast_shape(lv, rv):
            """The broadcast of two int shapes of one rank, or None (another rank, a non-int
            dim or a mismatch: Triton's code decides)."""
            if len(lv) != len(rv):
                return None
            ret = []
            for a, b in zip(lv, rv):
                if type(a) is not int or type(b) is not int:
                    return None
                if a == 1:
                    ret.append(b)
                elif b == 1 or a == b:
                    ret.append(a)
                else:
                    return None
            return ret

        # -- two tensors of one non-pointer dtype: the computation type is that dtype
        # (computation_type_impl of equal types), so the casts are no-ops and only the
        # broadcast remains; except a floating div/mod, promoted to fp32 by Triton's rules
        orig_binary_check = TritonSemantic.binary_op_type_checking_impl

        # -- a tensor and a Python int/float (``x * 0.5``, ``offs + 1``, ``tl.where(c, x, 0.0)``):
        # Triton's steps in Triton's order -- the scalar's type, the computation type, the
        # casts, the broadcast -- minus the ``numbers.Number`` ABC checks, the pointer checks
        # that cannot fire and the promotion walk, whose result depends only on the two dtype
        # names, which side is the scalar and div/mod (cached; a TypeError is not cached and
        # comes from Triton's own code). Bools and every other class take Triton's path.
        computation_types: dict = {}
        py_scalars = (int, float)
        splats: dict = {}
        TensorHandle = _interp.TensorHandle

        def binary_op_type_checking_impl(self, lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False,
                                         arithmetic_check=True, div_or_mod=False):
            lt, rt = type(lhs), type(rhs)
            if lt is tensor:
                if rt is tensor:
                    ld, rd = lhs.dtype, rhs.dtype
                    if type(ld) is dtype_cls and type(rd) is dtype_cls and ld.name == rd.name and not (
                            div_or_mod and ld.is_floating()):
                        return self.broadcast_impl_value(lhs, rhs)
                elif rt in py_scalars:
                    return scalar_operand(self, lhs, rhs, False, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check,
                                          div_or_mod)
            elif rt is tensor and lt in py_scalars:
                return scalar_operand(self, rhs, lhs, True, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)
            return orig_binary_check(self, lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)

        def scalar_operand(self, t, v, scalar_left, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod):
            td = t.dtype
            sd = self.to_tensor_type(v)
            tcls = type(td)
            if tcls is dtype_cls and arithmetic_check:
                key = (td.name, sd.name, scalar_left, div_or_mod)
                ret = computation_types.get(key)
                if ret is None:
                    if scalar_left:
                        ret = self.computation_type_impl(sd, True, td, False, div_or_mod)
                    else:
                        ret = self.computation_type_impl(td, False, sd, True, div_or_mod)
                    computation_types[key] = ret
                pointer = False
            elif tcls is pointer_type and (allow_lhs_ptr if not scalar_left else allow_rhs_ptr) and sd.is_int():
                # pointer +- int: no arithmetic promotion, the int becomes its own scalar
                ret, pointer = sd, True
            else:
                lhs, rhs = (v, t) if scalar_left else (t, v)
                return orig_binary_check(self, lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)
            tt = t.type
            skey = None
            if type(tt) is block_type:
                shape = int_key(tt.shape.values)
                if shape is not None:
                    # the scalar splat over the block: one read-only array per value, type and
                    # shape (floats keyed by their hex text, so -0.0 and nan stay apart)
                    skey = (ret.name, type(v), v.hex() if type(v) is float else v, shape)
                    ent = splats.get(skey)
                    if ent is not None:
                        if not pointer:
                            t = self.cast(t, ret)
                        s = tensor(TensorHandle(ent[0], ent[1]), ent[2])
                        return (s, t) if scalar_left else (t, s)
            if pointer:
                s = self.to_tensor(v)
            elif scalar_left:  # Triton casts lhs first: the scalar's range errors come first
                s = self._cast_to_computation_type(v, ret)
                t = self.cast(t, ret)
            else:
                t = self.cast(t, ret)
                s = self._cast_to_computation_type(v, ret)
            pair = self.broadcast_impl_value(s, t) if scalar_left else self.broadcast_impl_value(t, s)
            if skey is not None:
                s = pair[0] if scalar_left else pair[1]
                if type(s.type) is block_type:
                    # read-only, as np.broadcast_to's views that the interpreter's ops
                    # already take as operands: shared, never written
                    s.handle.data.setflags(write=False)
                    if len(splats) >= 4096:
                        splats.clear()
                    splats[skey] = (s.handle.data, s.handle.dtype, s.type)
            return pair

        # -- TensorHandle's size check (numpy item bits <= the dtype's, 8 at least): per
        # (itemsize, dtype name); pointers always pass
        orig_validate = _interp._validate_np_data_size
        size_ok: dict = {}

        def validate_np_data_size(np_array, tl_dtype):
            if type(tl_dtype) is dtype_cls:
                key = (np_array.itemsize, tl_dtype.name)
                r = size_ok.get(key)
                if r is None:
                    r = size_ok[key] = orig_validate(np_array, tl_dtype)
                return r
            return orig_validate(np_array, tl_dtype)

        # -- ``x[:, None]`` / ``x[None, :]`` of a 1-D block: Triton's ``expand_dims`` (the same
        # block type and builder call) without its per-index loop; any other index goes to
        # Triton's ``__getitem__`` (and its errors)
        full = slice(None)

        def is_full_slice(sl):
            return type(sl) is slice and sl.start is None and sl.stop is None and sl.step is None

        def expand_dims_getitem(orig_getitem):
            def getitem(self, slices, _semantic=None):
                if type(slices) is builtins.tuple and len(slices) == 2 and type(self.type) is block_type:
                    a, b = slices
                    shape = self.type.shape.values
                    if len(shape) == 1 and type(shape[0]) is int:
                        # the view np.expand_dims (create_expand_dims) makes, by indexing
                        if b is None and is_full_slice(a):
                            index, new_shape = (full, None), [shape[0], 1]
                        elif a is None and is_full_slice(b):
                            index, new_shape = (None, full), [1, shape[0]]
                        else:
                            index = None
                        if index is not None and self.handle.data.ndim == 1:
                            h = self.handle
                            return tensor(TensorHandle(h.data[index], h.dtype.scalar),
                                          block_type(self.type.scalar, new_shape))
                return orig_getitem(self, slices, _semantic=_semantic)

            return getitem

        # -- the launch's patched language builtins: call the builtin's function directly
        # instead of through its ``@builtin`` wrapper, whose only job is to refuse a call
        # without ``_semantic`` (the interpreter always passes one)
        orig_patch_attr = _interp._patch_attr
        builtin_code = core.builtin(lambda _semantic=None: None).__code__
        semantic = _interp.interpreter_semantic

        def patch_attr(obj, name, member, builder, scope):
            fn = getattr(member, "__wrapped__", None)
            if fn is None or getattr(member, "__code__", None) is not builtin_code:
                return orig_patch_attr(obj, name, member, builder, scope)
            if obj is tensor and name == "__getitem__":
                fn = expand_dims_getitem(fn)

            def new_member(*args, **kwargs):
                kwargs.pop("_semantic", None)
                return fn(*args, **kwargs, _semantic=semantic)

            scope.set_attr(obj, name, new_member)

        # -- after a launch the interpreter copies each argument's host storage back to the
        # device storage; on CPU they are the same storage, so the copy (of the whole KV
        # cache, every launch) is memory onto itself: skipped when every pair is one storage
        orig_restore = _interp.GridExecutor._restore_args_dev
        unwrap_tensor = _interp._unwrap_tensor

        def restore_args_dev(self, args_dev, args_hst, kwargs, kwargs_hst):
            pairs = list(zip(args_dev, args_hst)) + [(kwargs[k], kwargs_hst[k]) for k in kwargs]
            for dev, hst in pairs:
                if hasattr(dev, "data_ptr"):
                    sd, sh = unwrap_tensor(dev).untyped_storage(), unwrap_tensor(hst).untyped_storage()
                    if sd.data_ptr() != sh.data_ptr() or sd.nbytes() != sh.nbytes() or sd.device != sh.device:
                        return orig_restore(self, args_dev, args_hst, kwargs, kwargs_hst)
                elif not isinstance(dev, (int, float, bool, str, type(None))):
                    return orig_restore(self, args_dev, args_hst, kwargs, kwargs_hst)
            return None

        # -- _convert_float (bf16 <-> fp32 casts, FP8 decoding): bit arithmetic over numpy
        # arrays, ~150 us a call, elementwise -- each output depends only on its input's
        # bits. From a 16-bit or narrower type every input is one of <= 65536 codes, so the
        # function is evaluated once on all of them (Triton's own code) and later calls look
        # their codes up in that table: the same bits by construction.
        orig_convert = _interp._convert_float
        convert_tables: dict = {}
        convert_scalars: dict = {}

        def convert_float(input, input_dtype, output_dtype, rounding_mode):
            bits = input_dtype.primitive_bitwidth
            if bits > 16:
                if input.size != 1:
                    return orig_convert(input, input_dtype, output_dtype, rounding_mode)
                # a wider single value: a scalar constant of a narrow type (``other=0.0`` of
                # a bf16 load, ``tl.full(..., 0.0, tl.bfloat16)``), converted once per value
                key = (input_dtype.name, output_dtype.name, rounding_mode, input.shape, input.tobytes())
                out = convert_scalars.get(key)
                if out is None:
                    if len(convert_scalars) >= 4096:  # runtime values, not constants: stay bounded
                        convert_scalars.clear()
                    out = convert_scalars[key] = orig_convert(input, input_dtype, output_dtype, rounding_mode)
                return out.copy()
            key = (input_dtype.name, output_dtype.name, rounding_mode)
            table = convert_tables.get(key)
            uint = getattr(np, f"uint{bits}")
            if table is None:
                table = convert_tables[key] = orig_convert(np.arange(1 << bits, dtype=uint), input_dtype,
                                                           output_dtype, rounding_mode)
            return table[np.frombuffer(input.tobytes(), dtype=uint)].reshape(input.shape)

        # -- each launch patches the builtins of ``triton.language`` (and ``tensor``,
        # ``math``, ...) found by ``inspect.getmembers``, a sorted walk of every attribute:
        # ~1.5 ms a launch. The builtins of a package are found once, while it is unpatched
        # (a patched package has none left), and reused while each name still holds the
        # same builtin, i.e. the package is unpatched again; otherwise Triton's walk runs.
        orig_patch_builtin = _interp._patch_builtin
        builtin_members: dict = {}

        def patch_builtin(pkg, builder, scope):
            members = builtin_members.get(pkg)
            if members is None:
                import inspect
                members = [(n, m) for n, m in inspect.getmembers(pkg) if core.is_builtin(m)]
                if not members:
                    return None  # patched already (or nothing to patch): as Triton's walk
                builtin_members[pkg] = members
            elif not all(getattr(pkg, n, None) is m for n, m in members):
                return orig_patch_builtin(pkg, builder, scope)
            for n, m in members:
                _interp._patch_attr(pkg, n, m, builder, scope)
            return None

        convert_float._mla_orig = orig_convert  # for the tests
        for f in (get_np_dtype, unwrap_if_constexpr, block_init, tensor_init, dtype_eq, dtype_is_int,
                  broadcast_impl_value, binary_op_type_checking_impl, validate_np_data_size, patch_attr,
                  restore_args_dev, convert_float, patch_builtin):
            f._mla_fuzz = True
        _interp._validate_np_data_size = validate_np_data_size
        _interp._patch_attr = patch_attr
        _interp.GridExecutor._restore_args_dev = restore_args_dev
        _interp._get_np_dtype = get_np_dtype
        _interp._convert_float = convert_float
        _interp._patch_builtin = patch_builtin
        core._unwrap_if_constexpr = unwrap_if_constexpr
        block_type.__init__ = block_init
        dtype_cls._mla_t = tensor_entry(())
        block_type._mla_t = None
        tensor.__init__ = tensor_init
        dtype_cls.__eq__ = dtype_eq
        dtype_cls.is_int = dtype_is_int
        TritonSemantic.broadcast_impl_value = broadcast_impl_value
        TritonSemantic.binary_op_type_checking_impl = binary_op_type_checking_impl
    except (AttributeError, ImportError) as e:  # pragma: no cover - a Triton laid out otherwise
        raise _layout_error("an attribute the type caching replaces", e) from e


def _prod(values) -> int:
    n = 1
    for v in values:
        n *= v
    return n


# -- CPU launch ------------------------------------------------------------------------------
# Each interpreted launch (``GridExecutor.__call__``) costs about 1.5 ms before the kernel's
# first op, and an emulated fuzz step launches ~6 kernels. On the CPU three parts of it are
# overhead: every tensor argument re-made as a "host" tensor and copied back after the grid
# (host and device are one storage there; each tensor call also passes through any active
# torch function mode: under the fuzzer's emulated capture, the host-read guard), the
# arguments bound with ``inspect.getcallargs`` on every launch, and ``triton.language``'s ~200
# builtins patched before the grid and restored after it. ``_install_cpu_launch`` replaces
# ``GridExecutor.__call__`` by a version that, when every tensor argument (also inside tuples
# and tensor descriptors) is a plain CPU tensor, passes the arguments as they are, binds them
# with a signature read once per function, and leaves ``triton.language`` patched (in a
# process that interprets its kernels nothing else calls those builtins). Everything else is
# Triton's own code path; any other argument takes Triton's original ``__call__``.

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


def _install_cpu_launch() -> None:
    """A shorter launch for CPU arguments (module doc, "CPU launch"): installed on
    ``triton.runtime.interpreter.GridExecutor``. Idempotent."""
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
    except (AttributeError, ImportError) as e:  # pragma: no cover - a Triton laid out otherwise
        raise _layout_error("the interpreter's launch (GridExecutor)", e) from e
