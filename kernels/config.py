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

from mla_fuzz.mla_ref import ModelSpec

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
    all), skip its redundant re-patching on nested jit calls (``_skip_nested_repatching``)
    and cache its per-op type bookkeeping (``_cache_interpreter_types``) and launch set-up
    for CPU arguments (``interp_launch``); numerics unchanged, ``MLA_FUZZ_PLAIN_INTERPRETER=1``
    turns those two off.

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
    _cache_interpreter_types()
    if os.environ.get(PLAIN_INTERPRETER_ENV, "0") in ("", "0"):
        from . import interp_launch
        interp_launch.install()


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


# Set MLA_FUZZ_PLAIN_INTERPRETER=1 (before the first launch) to run Triton's interpreter
# without ``_cache_interpreter_types`` -- to rule it out when chasing an odd result; the
# test-suite also uses it to check that results are bit-identical either way.
PLAIN_INTERPRETER_ENV = "MLA_FUZZ_PLAIN_INTERPRETER"


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
    minus identity broadcasts and self-copies, and ``tests/test_interpreter_speedups.py``
    checks forwards and a kernel of odd operands bit for bit against the plain interpreter.
    """
    if os.environ.get(PLAIN_INTERPRETER_ENV, "0") not in ("", "0"):
        return
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
    except Exception:  # pragma: no cover - another Triton layout: keep its behaviour
        pass


def _prod(values) -> int:
    n = 1
    for v in values:
        n *= v
    return n


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
      batch's total tile count into at most ``num_parts`` equal contiguous ranges (the fewest
      that keep the longest at ``cdiv(total, num_parts)`` tiles; ``kernels/planner.py``); a
      request crossed by a cut is split, its pieces merged by the combine kernel.
    - ``min_tiles_per_part``: fewer parts are used when the batch is short, so a part
      gets at least this many tiles (combine work would dominate) -- except, above 2, a batch
      of short requests too small for half the parts, which gets parts of two tiles
      (``kernels/planner.py``, ``SHORT_PARTS``).
    - ``num_warps`` / ``num_stages``: Triton's; ignored by the interpreter.
    - ``combine_block_m``: rows per combine program.
    - ``combine_col_blocks``: combine programs per row block, each merging ``rank /
      combine_col_blocks`` latent columns (must leave a power of two); more programs for
      small batches of long, many-piece requests on the GPU (``kernels/combine.py``).
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
    combine_col_blocks: int = 1
    fp8_prefetch: bool = False
    fp8_grouped: bool = True

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "combine_block_m"):
            v = getattr(self, name)
            if not _is_pow2(v) or v < 16:
                raise ValueError(f"DecodeConfig.{name} must be a power of two >= 16, got {v}")
        for name in ("num_parts", "min_tiles_per_part", "num_warps", "num_stages", "combine_col_blocks"):
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


def _wgmma_device(device: torch.device) -> bool:
    """Whether 64-row blocks on ``device`` take the Hopper Gluon kernel
    (``kernels/decode_wgmma.py``: compute capability 9.x, Gluon importable, its switch on).
    A CUDA device on a machine without CUDA (tests asking for the CUDA defaults) counts as the
    H100 the defaults were tuned on, as in ``_sm_count``."""
    from . import decode_wgmma
    if decode_wgmma.gluon is None or not decode_wgmma.WGMMA_DECODE:
        return False
    try:
        return torch.cuda.get_device_capability(device)[0] == 9
    except Exception:  # pragma: no cover - no CUDA
        return True


def _keys_device() -> bool:
    """Whether FP8 blocks of up to 32 query rows may take the keys-on-M Gluon kernel
    (``kernels/decode_wgmma_keys.py``) on a device ``_wgmma_device`` accepts: its switch
    ``decode_wgmma.WGMMA_KEYS`` (the warp-specialised kernels take them first where theirs
    are on: ``_ws_device``, ``_ws64_device``)."""
    from . import decode_wgmma
    return bool(decode_wgmma.WGMMA_KEYS)


def _ws64_device() -> bool:
    """Whether FP8 64-row blocks take the warp-specialised Gluon kernel
    (``kernels/decode_wgmma_ws64.py``) on a device ``_wgmma_device`` accepts: its switch
    ``decode_wgmma.WGMMA_WS64`` (``decode_wgmma.ws64_taken``)."""
    from . import decode_wgmma
    return bool(decode_wgmma.WGMMA_WS64)


def _ws_device() -> bool:
    """Whether FP8 blocks of up to 16 query rows take the blocks of the warp-specialised Gluon
    kernel (``kernels/decode_wgmma_ws.py``; on a cache TMA can copy, the register-operand
    ``kernels/decode_wgmma_rs.py`` runs them) where the keys-on-M one is taken: the switch
    ``decode_wgmma.WGMMA_WS``."""
    from . import decode_wgmma
    return bool(decode_wgmma.WGMMA_WS)


def _kt_device() -> bool:
    """Whether 16-bit blocks of up to 32 query rows take the TMA keys-on-M Gluon kernel
    (``kernels/decode_wgmma_kt.py``) on a device ``_wgmma_device`` accepts: its switch
    ``decode_wgmma.WGMMA_KT``."""
    from . import decode_wgmma
    return bool(decode_wgmma.WGMMA_KT)


def _gluon_spec(spec: ModelSpec, fp8: bool) -> bool:
    """Whether ``spec``'s shapes are those the Hopper Gluon kernels are written for
    (``decode_wgmma.wgmma_plan``: rank 512 + rope 64, and for an FP8 cache scale groups of 128)."""
    from . import decode_wgmma
    return ((spec.kv_lora_rank, spec.qk_rope_head_dim) == (512, 64)
            and (not fp8 or spec.fp8_group == decode_wgmma.FP8_GROUP))


def _sm_count(device: torch.device) -> int:
    try:
        return torch.cuda.get_device_properties(device).multi_processor_count
    except Exception:  # pragma: no cover - no CUDA
        return 132


def _fp8_grouped_default(rows: int, device_type: str = "cuda") -> bool:
    """Whether the default config of ``rows`` query rows per request (``s_q * heads``)
    takes the FP8 grouped-dot path.

    CUDA: up to 16 rows. With fp16 dots (``decode_split.FP8_FP16_DOTS``) it beat the
    dequantise path at 16 rows too (H100, h=16: 1.05-1.07x with TMA loads, B 32/128, L 1k-16k,
    ``benchmarks/results/h100-2026-11-26-fp8-f16.json``); above 16 rows the default is the
    64-row block (``default_config``), and 64-row blocks always dequantise
    (``decode_split.GROUPED_MAX_BLOCK_M``). CPU (the interpreter): 17-32 rows, so the fuzzer's
    CPU runs cover both FP8 paths (the tiny spec's 8-16 heads at s_q 1-4 span 8-64 rows),
    the dequantise one, with one dot per tile instead of four, where it is also the cheaper
    to interpret."""
    if device_type == "cuda":
        return rows <= 16
    return 16 < rows <= 32


#: the largest (padded) batch whose h=16 x 2 launches take two 16-row blocks on Hopper
#: (``default_config``'s ``batch``): in the A/B behind it they were faster at B 1-4 up to 64k
#: tokens (0.97-0.99x at B=4, L=32k) and slower at B=8, L=16k (0.90-0.94x)
SPLIT_ROWS_MAX_BATCH = 4


def default_config(spec: ModelSpec, s_q: int, device: Optional[torch.device] = None, *,
                   fp8: bool = False, sparse: bool = False, batch: Optional[int] = None) -> DecodeConfig:
    """The configuration ``mla_decode`` and the backend use unless given one.

    On CPU (interpreter) the tiles are large (one row block per request, 64 keys) and the
    parts few (an odd count, so cuts fall inside requests and splits get exercised); FP8
    caches dequantise up to 16 rows and take the grouped path above, so both get fuzzed
    (``_fp8_grouped_default``).
    On CUDA the values are the best of the sweeps recorded in ``benchmarks/results`` (H200
    and H100, Triton 3.6): the row block follows the query rows per request (heads x MTP
    tokens) — 16/32 rows for the memory-bound small-head case, 64 rows to feed the tensor
    cores when there are many heads; one persistent program per SM (``num_parts * m_blocks
    = SMs``) beat two per SM in every swept case; FP8 caches take the grouped-dot path with
    fp16 dots at up to 16 rows (128-key tiles, twin loads; H100,
    ``h100-2026-11-26-config-sweep-pageconst.json``) and the 64-row block above that, 17-32
    rows included (its padding rows masked; ``h100-2026-11-26-fp8-m64-h16.json``); 64-row
    blocks always dequantise (``decode_split.GROUPED_MAX_BLOCK_M``), FP8 ones over 128-key
    tiles with P through memory (``decode_split.fp8_p_via_memory``) -- except on Hopper for
    the shapes the Gluon kernels are written for (rank 512 + rope 64, FP8 groups of 128), where
    64-row blocks of 64-key tiles run the Gluon kernel ``kernels/decode_wgmma.py`` (which took
    h=16 bf16 at s_q=2 too, its rows padded to 64, before the TMA kernel below), and h=16 FP8
    takes the few-row Gluon kernel ``kernels/decode_wgmma_keys.py`` (16/32-row blocks of
    128-key tiles), and h=16 bf16 / fp16 at s_q 1-2 the TMA one of ``kernels/decode_wgmma_kt.py``
    (16- or 32-row blocks of 64-key tiles, 4 warps); the combine splits the latent columns in 128s.

    ``batch``: the (padded) batch size the launches are for, where the best blocks depend on
    it: on Hopper, 17-32 query rows (h=16 x 2) of at most ``SPLIT_ROWS_MAX_BATCH`` requests
    take two 16-row blocks of the few-row kernels (``decode_wgmma_rs`` / ``decode_wgmma_kt``),
    one program a part and row block, rather than one block of all the rows. None: no batch
    (the blocks of larger batches).

    ``sparse``: the sparse top-k decode, whose unit is one (request, token) row (pass
    ``s_q=1``); on CPU its key tile is 32 wide — each tile is one interpreted loop trip, and
    the fuzzer's top-k of up to 64 still spans two tiles, so splits are exercised.
    """
    device = torch.device(device) if device is not None else None
    rows = s_q * spec.num_heads
    if device is None or device.type != "cuda":
        # Interpreted cost is per executed op, almost independent of tile size, so CPU tiles
        # are as large as coverage allows: every query row of a request in one row block,
        # 64-key tiles for the dense decode (a fuzz step has ~4 tiles a launch at 32 keys;
        # 64 took a tenth off an emulated fuzz step) — still two or more tiles for requests
        # longer than 64 keys (pages of 16 and 64), so cuts inside requests (split-KV +
        # combine) stay common: 38% of the fuzzer's decode launches had a split request at
        # 64 keys, 52% at 32. FP8 caches take the dequantise path up to 16 rows and the
        # grouped one above (``_fp8_grouped_default``): both paths get fuzzed.
        block_m = min(max(next_pow2(rows), 16), 64)
        return DecodeConfig(block_m=block_m, block_n=32 if sparse else 64, num_parts=5, min_tiles_per_part=1,
                            num_warps=4, num_stages=1, combine_block_m=block_m,
                            fp8_grouped=_fp8_grouped_default(rows, "cpu"))
    grouped = _fp8_grouped_default(rows)
    # the Gluon kernels' shapes only for a spec they are written for (wgmma_plan's checks: rank
    # 512 + rope 64, FP8 groups of 128): other specs (the tiny one the fuzzer runs) keep the
    # Triton kernel's own tuned blocks rather than Gluon-shaped ones that kernel would run
    gluon = not sparse and _wgmma_device(device) and _gluon_spec(spec, fp8)
    # Re-swept on an H100 after the page size became a compile-time constant
    # (benchmarks/results/h100-2026-11-26-config-sweep-pageconst.json; B 8-128, L 1k-16k):
    min_tiles = 2
    if rows <= 16:
        # FP8: grouped fp16 dots over 128-key tiles, twin loads, 2 stages: 1.10x the 64-key TMA
        # config (which needs the tile inside one page, so 128-key tiles take it only at pages
        # of 128+); bf16: unchanged, still the best of 7
        block_m, block_n, warps, stages = (16, 128, 8, 2)
    elif rows <= 32 and not fp8:
        # bf16: 128-key tiles at 3 stages, 1.04x the former 64-key / 2-stage config (faster in
        # 4 of its 5 cases, 1.2x at B=128, L=16k)
        block_m, block_n, warps, stages = (32, 128, 8, 3)
    else:
        # FP8 at 17-32 rows (h=16, s_q=2) takes the 64-row block too, its padding rows masked:
        # the wgmma kernel with P through memory against the 32-row grouped mma.sync one (64-key
        # tiles, 2 stages): 0.99-1.28x over B 1-128, L 1k-16k, 1.12-1.28x at B >= 8, L=16k.
        # Not at 16 rows: 0.94x at B=128, L=16k (h100-2026-11-26-fp8-m64-h16.json).
        # FP8: 128-key tiles, one stage, P through memory (decode_split module doc): 1.05-1.14x
        # the 64-key / 2-stage config at B 32/128 (h100-2026-11-26-fp8-pmem.json); parts of one
        # tile: short requests spread over more SMs (B=1, L=1k: 1.28x parts of two tiles), never
        # slower than the former config over B 1-128, L 1k-16k (h100-2026-11-26-fp8-h128-min-tiles.json);
        # bf16 unchanged
        block_m, block_n, warps, stages = (64, 128, 8, 1) if fp8 else (64, 64, 8, 2)
        min_tiles = 1 if fp8 else 2
        if fp8 and gluon:
            # Hopper: the Gluon kernel (kernels/decode_wgmma.py; dense only), written for 64-key tiles:
            # 0.99-1.23x the Triton kernel's 128-key default above (h100-2026-11-26-wgmma-ab-fp8.json;
            # bf16 keeps its tiles, already 64 keys). Parts of two tiles, the 128 keys of the
            # former parts of one: parts of one 64-key tile split B=1, L=4k (h=128, s_q=1) over
            # twice the pieces and ran 0.89x (h100-2026-11-26-kernel-9-*.json). These blocks now
            # run the warp-specialised kernels/decode_wgmma_ws64.py (decode_wgmma.ws64_taken)
            block_n, min_tiles = 64, 2
    if gluon and rows <= 32 and (fp8 or rows > 16):
        # Hopper, h=16 (FP8 at s_q 1-2, bf16 at s_q=2): the Gluon 64-row kernel too, its
        # padding rows masked. Against the Triton defaults above over B 1-128, L 1k-16k: bf16
        # s_q=2 1.02-1.20x and FP8 s_q=1 0.96-1.15x (below 1 only at B=1, L 1k-4k) in parts of
        # four 64-key tiles -- parts of two split B=1, L=16k over 128 pieces and ran 0.86x
        # there (h100-2026-11-26-wgmma-h16.json / -wgmma-h16-mt.json); FP8 s_q=2, whose Triton
        # default is the 64-row block above, 1.05-1.23x in parts of two, which four would slow
        # at B 1-8, L=1k (0.87-0.90x, h100-2026-11-26-kernel-10-*.json). bf16 at s_q=1
        # (16 rows) keeps its kernel: the 64-row one, pages a tile ahead, ran 0.84-1.08x over
        # the full grid (1.06-1.08x at 128k tokens, 0.84x / 0.87x at B=1, L 1k / 4k;
        # h100-2026-11-26-kernel-19-bf16-h16-sq1-64-row.json)
        block_m, block_n, warps, stages = 64, 64, 8, 2
        min_tiles = 2 if fp8 and rows > 16 else 4
        grouped = False
        if fp8 and rows > 16 and _ws64_device():
            # FP8 at 17-32 rows: the warp-specialised 64-row kernel (kernels/decode_wgmma_ws64.py),
            # parts of two tiles, against the keys-on-M kernel's 32-row blocks below: 0.99-1.09x
            # over B 1-128, L 1k-16k, geo-mean 1.03 (B=8, L=16k: 77.2 -> 72.6 us; old and new
            # code in one command, h100-2026-11-26-kernel-19*.json); parts of four tiles ran
            # B=8, L=1k 0.85x (h100-2026-11-26-h16-routes.json). That kernel runs these launches
            # through its keys-on-M consumer (no padding rows; 1.03x geo-mean, -kernel-23*.json),
            # since kernel-30 one warpgroup of every row beside an 8-warp producer (its launcher's
            # warps, whatever this config's 8)
            stages = 1
        elif fp8 and _keys_device():
            # FP8: the keys-on-M Gluon kernel (kernels/decode_wgmma_keys.py; 128-key tiles, the
            # query rows as the dots' N) against the 64-row one above, B 1-128, L 1k-16k, same
            # H100 and command: s_q=1 1.06-1.55x in parts of two tiles, s_q=2 1.03-1.34x in parts
            # of one (h100-2026-11-26-kernel-13*.json). Parts of one at s_q=1 split B=1, L=16k
            # over 128 pieces (0.77x); parts of two at s_q=2 slowed B 1-8, L=1k (0.82-0.84x)
            # (h100-2026-11-26-wgmma-keys-ab.json, 'v5' / 'v1')
            block_m, block_n, warps, stages = (16 if rows <= 16 else 32), 128, 8, 1
            min_tiles = 2 if rows <= 16 else 1
            if rows <= 16 and _ws_device():
                # up to 16 rows: the warp-specialised one (kernels/decode_wgmma_ws.py; a producer
                # warpgroup converts 64-key tiles for a consumer warpgroup's dots), parts of four
                # tiles (the same 256 keys): 1.03-1.14x the keys-on-M kernel over B 1-128, L 1k-16k,
                # 1.05-1.14x at B >= 8 (h100-2026-11-26-wgmma-ws-ab.json; in the full grid, old and
                # new code in one command: 1.04-1.14x, h100-2026-11-26-kernel-15*.json); parts of two tiles split
                # B=1, L=16k over twice the pieces (0.76x there). The register-operand kernel
                # (kernels/decode_wgmma_rs.py) runs these blocks where TMA can copy the cache,
                # measured at the same parts (1.06-1.31x ws, h100-2026-11-27-kernel-24*.json)
                block_n, warps, min_tiles = 64, 4, 4
    if gluon and rows <= 32 and not fp8 and _kt_device():
        # Hopper, 16-bit cache, up to 32 rows: the TMA keys-on-M Gluon kernel
        # (kernels/decode_wgmma_kt.py; where decode_wgmma.kt_plan refuses the cache, the Triton
        # kernel runs these blocks) in 16- or 32-row blocks, parts of four 64-key tiles (the
        # Triton blocks' 256 keys). Over B 1-128, L 1k-16k (h100-2026-11-27-wgmma-kt-ab.json):
        # 16 rows 1.00-1.24x the Triton defaults above, geo-mean 1.13; 32 rows 1.01-1.26x the
        # 64-row Gluon blocks above (parts of two tiles: 0.86x at B=1, L=16k). A batch of short
        # requests too small for half the parts at four tiles gets parts of two from the planner
        # (kernels/planner.py, SHORT_PARTS)
        block_m, block_n, warps, stages, min_tiles = (16 if rows <= 16 else 32), 64, 4, 1, 4
    if (gluon and 16 < rows <= 32 and batch is not None and batch <= SPLIT_ROWS_MAX_BATCH
            and (_ws_device() if fp8 else _kt_device())):
        # Hopper, h=16 x 2 at small batches: two 16-row blocks of 64-key tiles, 4 warps, parts of
        # two tiles, half the programs each row block (the few-row kernels: FP8 the
        # register-operand decode_wgmma_rs.py where TMA can copy the cache, 16-bit the TMA
        # decode_wgmma_kt.py). The pair of programs of a part read the same tiles at about the
        # same time (the second from L2), each converting / computing its 16 rows. Against the
        # blocks above, interleaved in one process on an H100 (h100-2026-11-27-split-rows-ab.json):
        # FP8 1.06-1.30x at B 1-2 (L 1k-32k), 0.97-1.15x at B=4 (0.97 at L=32k), 0.95-1.13x at
        # B=8 (0.95 at L=16k), 0.89-0.97x at B 32-128; bf16 1.04-1.23x at B 1-2, 0.99-1.22x at
        # B=4, 0.92-1.18x at B=8, 0.75-1.05x at B 32-128 -- at large batches each tile's
        # conversion and the dots' fixed costs paid twice outweigh the padding rows (FP8) and
        # spills (bf16) of the single block
        block_m, block_n, warps, stages, min_tiles = 16, 64, 4, 1, 2
        grouped = False
    m_blocks = -(-rows // block_m)
    parts = max(1, _sm_count(device) // m_blocks)
    # combine: 4 programs per row block, each merging 128 latent columns (rank 512): 1.02-1.04x
    # at h=16, B=8, L=16k (16 pieces a request; h100-2026-11-26-combine-cols.json), neutral at h=128
    return DecodeConfig(block_m=block_m, block_n=block_n, num_parts=parts, min_tiles_per_part=min_tiles,
                        num_warps=warps, num_stages=stages, combine_block_m=16,
                        combine_col_blocks=_combine_col_blocks(spec.kv_lora_rank), fp8_grouped=grouped)


def _combine_col_blocks(rank: int) -> int:
    """Column blocks of the GPU combine: 128-column blocks where the rank allows (at least
    one, and a power-of-two block, ``DecodeConfig.combine_col_blocks``)."""
    blocks = max(1, rank // 128)
    while blocks > 1 and (rank % blocks or (rank // blocks) & (rank // blocks - 1)):
        blocks -= 1
    return blocks
