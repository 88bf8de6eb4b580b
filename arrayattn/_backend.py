"""The backend layer: the one module that knows which array library it is talking to.

Everything else in arrayattn is written against the array API standard and asks this
module for the namespace, the device, the dtype policy, and which fast path (if any)
exists for a library.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import array_api_compat

Array = Any
"""Any array-API array (NumPy, CuPy, array-api-strict, PyTorch, JAX, Dask)."""

Namespace = Any
"""An array-API namespace, as returned by :func:`array_api_compat.array_namespace`."""

__all__ = [
    "Array",
    "Namespace",
    "namespace_of",
    "require_arrays",
    "resolve_namespace",
    "namespace_name",
    "namespace_from_name",
    "device_of",
    "library_name",
    "is_numpy",
    "is_cupy",
    "plain_array_types",
    "is_dask",
    "is_lazy",
    "compute_dtype",
    "lse_dtype",
    "is_real_floating",
    "sum_to_shape",
    "full_scalar",
    "broadcast_shapes",
    "known_shape",
    "to_floats",
    "exp_shifted",
    "workspace",
    "matmul_into",
    "where_allowed",
    "NumpyBridge",
    "numpy_bridge",
    "records_gradients",
    "available_memory",
    "physical_memory",
    "in_host_memory",
]


def library_name(xp: Namespace) -> str:
    """A short human name for the library behind ``xp`` (used in errors and reports)."""
    checks = (
        (array_api_compat.is_numpy_namespace, "numpy"),
        (array_api_compat.is_cupy_namespace, "cupy"),
        (array_api_compat.is_torch_namespace, "torch"),
        (array_api_compat.is_jax_namespace, "jax"),
        (array_api_compat.is_dask_namespace, "dask"),
        (array_api_compat.is_array_api_strict_namespace, "array_api_strict"),
    )
    for check, name in checks:
        if check(xp):
            return name
    return getattr(xp, "__name__", type(xp).__name__)


def is_numpy(xp: Namespace) -> bool:
    """True when ``xp`` is NumPy (plain or array-api-compat's wrapper)."""
    return bool(array_api_compat.is_numpy_namespace(xp))


def is_cupy(xp: Namespace) -> bool:
    """True when ``xp`` is CuPy (plain or array-api-compat's wrapper)."""
    return bool(array_api_compat.is_cupy_namespace(xp))


def is_dask(xp: Namespace) -> bool:
    """True when ``xp`` is Dask's array namespace (array-api-compat's wrapper)."""
    return bool(array_api_compat.is_dask_namespace(xp))


def is_lazy(xp: Namespace) -> bool:
    """True for libraries whose arrays may be traced or deferred (JAX, Dask): there no
    Python decision may be taken on array values (``bool(x)`` fails under ``jax.jit`` and
    computes a Dask graph)."""
    return bool(array_api_compat.is_jax_namespace(xp) or array_api_compat.is_dask_namespace(xp))


def to_floats(x: Array) -> list[float]:
    """A 1-D array's values as Python floats, brought to the host in one transfer (one
    synchronisation on a GPU instead of one per value; a PyTorch tensor is detached first,
    as its autograd warns when a tensor that requires grad becomes a number). Eager
    libraries only: on JAX or Dask this would trace or compute.

    Examples:
        >>> import numpy as np
        >>> to_floats(np.asarray([1.0, -2.5]))
        [1.0, -2.5]
    """
    if array_api_compat.is_torch_array(x):
        return [float(v) for v in x.detach().cpu().tolist()]
    if array_api_compat.is_cupy_array(x):
        return [float(v) for v in x.get().tolist()]
    if array_api_compat.is_numpy_array(x):
        return [float(v) for v in x.tolist()]
    return [float(x[i]) for i in range(int(x.shape[0]))]


def to_host_numpy(x: Array) -> Any:
    """A small array's values as a NumPy array on the host (one transfer from a GPU; a
    PyTorch tensor detached first; JAX arrays through ``numpy.asarray``). For metadata
    such as per-token document ids, never for the operands of a call.

    Examples:
        >>> import numpy as np
        >>> to_host_numpy(np.arange(3)).tolist()
        [0, 1, 2]
    """
    import numpy as np

    if array_api_compat.is_torch_array(x):
        return x.detach().cpu().numpy()
    if array_api_compat.is_cupy_array(x):
        return x.get()
    if array_api_compat.is_dask_array(x):
        return np.asarray(x.compute())
    return np.asarray(x)


_SCATTER_ELEMENTS = 1 << 22
"""One-hot elements per product in :func:`scatter_add`'s portable route (16 MiB in
float32)."""


def scatter_add(
    xp: Namespace, index: Array, values: Array, size: int, shape: tuple[int, ...] | None = None
) -> Array:
    """``out[index[i]] += values[i]`` into zeros of ``size`` (then reshaped to ``shape``),
    deterministically: the same sums in the same order on every run. NumPy uses
    ``bincount``; other libraries a one-hot product in bounded chunks (their scatter-adds
    use atomics on a GPU, whose order, and so the rounding, varies run to run).

    Examples:
        >>> import numpy as np
        >>> scatter_add(np, np.array([0, 2, 0]), np.array([1.0, 2.0, 3.0]), 3).tolist()
        [4.0, 0.0, 2.0]
    """
    if is_numpy(xp):
        import numpy as np

        out = np.bincount(np.asarray(index), weights=np.asarray(values), minlength=size)
        out = out.astype(values.dtype, copy=False)
    else:
        n = int(index.shape[0])
        dev = device_of(values)  # (a JAX tracer under vmap has no .device)
        slots = xp.arange(size, dtype=index.dtype, device=dev)
        chunk = max(1, _SCATTER_ELEMENTS // max(1, size))
        out = xp.zeros((size,), dtype=values.dtype, device=dev)
        for i in range(0, n, chunk):
            j = min(n, i + chunk)  # (slices past the end are unspecified in the array API)
            onehot = xp.astype(index[i:j, None] == slots, values.dtype)
            out = out + xp.matmul(values[None, i:j], onehot)[0, ...]
    return out if shape is None else xp.reshape(out, shape)


def known_shape(name: str, x: Array) -> tuple[int, ...]:
    """``x.shape`` as Python ints; a ``ValueError`` naming ``name`` when a size is unknown
    (``None`` in the array API standard, NaN in Dask after boolean indexing or
    ``to_dask_array()``): attention plans its work from the sizes.

    Examples:
        >>> import numpy as np
        >>> known_shape("query", np.ones((2, 3)))
        (2, 3)
    """
    sizes = tuple(x.shape)
    if all(type(d) is int for d in sizes):  # the common case, without the checks below
        return sizes
    unknown = [ax for ax, d in enumerate(sizes) if d is None or d != d]  # d != d: NaN
    if not unknown:
        return tuple(int(d) for d in sizes)
    hint = ""
    if hasattr(x, "compute_chunk_sizes"):  # Dask: the sizes are one compute away
        hint = f"; call {name}.compute_chunk_sizes() first"
    raise ValueError(
        f"{name} has unknown size along axis {unknown[0]} (shape {sizes}); expected known "
        f"sizes{hint}"
    )


# Per-call host cost matters: a decode step on a GPU moves a few MB (microseconds at HBM
# speed) and its Python dispatch is the call's speed. The two lookups below depend only on
# an array's type (and a dtype), so they are remembered per type; the caches stay small
# (one entry per array type or dtype a process meets) and are bounded all the same.
_CACHE_LIMIT = 256
_NAMESPACE_BY_TYPE: dict[type, Namespace] = {}
_FLOATING: dict[tuple[int, Any], bool] = {}
_DEVICE_ATTRIBUTE_TYPES: dict[ModuleType | None, tuple[type, ...]] = {}


def plain_array_types() -> tuple[type, ...]:
    """The array types whose attributes say all a call needs to know about them (NumPy 2
    ndarrays, CuPy ndarrays once CuPy is imported): ``.device`` is what
    ``array_api_compat.device`` returns, and no autograd or tracing state rides on them.

    Examples:
        >>> import numpy as np
        >>> np.ndarray in plain_array_types()
        True
    """
    cupy = sys.modules.get("cupy")
    types = _DEVICE_ATTRIBUTE_TYPES.get(cupy)
    if types is None:
        import numpy

        found: list[type] = []
        if hasattr(numpy.empty(0), "device"):
            found.append(numpy.ndarray)
        cupy_type = getattr(cupy, "ndarray", None)
        if isinstance(cupy_type, type):
            found.append(cupy_type)
        types = _DEVICE_ATTRIBUTE_TYPES[cupy] = tuple(found)
    return types


def device_of(x: Array) -> Any:
    """The device an array lives on, in its own library's terms."""
    if type(x) in plain_array_types():
        return x.device
    return array_api_compat.device(x)


def namespace_of(**arrays: Array | None) -> Namespace:
    """The one namespace shared by the named arrays (``None`` entries are ignored).

    Raises ``TypeError`` naming the arguments when an entry is not an array, when the
    arrays come from two libraries, or when they live on two devices.
    """
    present = {name: a for name, a in arrays.items() if a is not None}
    if not present:
        listed = " / ".join(arrays) or "an array argument"
        raise TypeError(f"{listed} must be an array from an array-API library, got None")
    namespaces: dict[str, Namespace] = {}
    for name, a in present.items():
        xp_a = _NAMESPACE_BY_TYPE.get(type(a))
        if xp_a is None:
            if not array_api_compat.is_array_api_obj(a) or isinstance(
                a, (bool, int, float, complex)
            ):
                raise TypeError(
                    f"{name} must be an array from an array-API library, got {type(a).__name__}"
                )
            xp_a = array_api_compat.array_namespace(a)
            if len(_NAMESPACE_BY_TYPE) < _CACHE_LIMIT:
                _NAMESPACE_BY_TYPE[type(a)] = xp_a
        namespaces[name] = xp_a
    names = list(present)
    first = names[0]
    xp = namespaces[first]
    for name in names[1:]:
        if namespaces[name] is not xp:
            raise TypeError(
                f"{name} is a {library_name(namespaces[name])} array but {first} is a "
                f"{library_name(xp)} array; all arrays in one call must come from one library"
            )
    dev = device_of(present[first])
    for name in names[1:]:
        other = device_of(present[name])
        # A JAX tracer under jax.jit has no device (None); concrete arrays the traced
        # function closes over (lengths, sinks) are placed by JAX, not a mismatch.
        if other != dev and other is not None and dev is not None:
            raise TypeError(
                f"{name} is on device {other!r} but {first} is on device {dev!r}; all arrays "
                f"in one call must be on one device"
            )
    return xp


def require_arrays(**arrays: Array | None) -> None:
    """Raise a ``TypeError`` naming the first required argument that is ``None``
    (:func:`namespace_of` skips ``None``, which optional arrays use)."""
    for name, a in arrays.items():
        if a is None:
            raise TypeError(f"{name} must be an array from an array-API library, got None")


def resolve_namespace(xp: ModuleType | Namespace | None) -> Namespace:
    """Turn a user-passed library (``numpy``, ``cupy``, ``torch``, ...) into its array-API
    namespace. ``None`` means NumPy."""
    if xp is None:
        import numpy

        xp = numpy
    try:  # array_api_compat's recognisers read a module's name, through a cache
        named = isinstance(getattr(xp, "__name__", None), str) and hash(xp) is not None
    except TypeError:  # unhashable
        named = False
    if not named:
        raise TypeError(
            f"xp must be an array-API namespace (a module) such as numpy or cupy, got "
            f"{type(xp).__name__} {xp!r:.80}"
        )
    if array_api_compat.is_numpy_namespace(xp):
        return array_api_compat.array_namespace(_numpy_probe())
    if array_api_compat.is_cupy_namespace(xp):
        import array_api_compat.cupy as compat_cupy

        return compat_cupy
    if array_api_compat.is_torch_namespace(xp):
        import array_api_compat.torch as compat_torch

        return compat_torch
    if array_api_compat.is_dask_namespace(xp):
        import array_api_compat.dask.array as compat_dask

        return compat_dask
    if hasattr(xp, "asarray") and hasattr(xp, "matmul"):
        return xp
    raise TypeError(f"xp must be an array-API namespace such as numpy or cupy, got {xp!r}")


def namespace_name(xp: Namespace) -> str:
    """The importable module name of the namespace ``xp`` (``"array_api_compat.numpy"``,
    ``"jax.numpy"``, ``"array_api_strict"``, ...), which :func:`namespace_from_name` turns
    back into ``xp``: how objects holding a namespace (caches) pickle it, since a module
    cannot be pickled. A ``TypeError`` names ``xp`` when it is no importable module.

    Examples:
        >>> import numpy as np
        >>> namespace_name(resolve_namespace(np))
        'array_api_compat.numpy'
    """
    import sys

    name = getattr(xp, "__name__", None)
    if not isinstance(name, str) or sys.modules.get(name) is not xp:
        raise TypeError(
            f"the array namespace {xp!r} is not an importable module, so it cannot be "
            f"pickled by name; use numpy, cupy, torch, jax.numpy, dask.array or "
            f"array_api_strict (or array-api-compat's wrapper of one)"
        )
    return name


def namespace_from_name(name: str) -> Namespace:
    """The namespace :func:`namespace_name` named, imported (and resolved as an ``xp=``
    argument is) in this process.

    Examples:
        >>> import numpy as np
        >>> namespace_from_name("array_api_compat.numpy") is resolve_namespace(np)
        True
    """
    import importlib

    if not isinstance(name, str):
        raise TypeError(f"name must be a module name (str), got {type(name).__name__}")
    return resolve_namespace(importlib.import_module(name))


def array_namespace(*arrays_or_library: Any) -> Namespace:
    """The array-API namespace arrayattn uses for some arrays, or for a library.

    Given arrays (NumPy, CuPy, PyTorch, JAX, array-api-strict, Dask, ...), their common
    namespace, as ``array_api_compat.array_namespace`` gives it; arrays of different
    libraries or devices are a ``TypeError`` naming them. Given one library module
    (``numpy``, ``cupy``, ``torch``, ``jax.numpy``, ``array_api_strict``, ``dask.array``)
    or ``None`` (NumPy), that library's namespace: what ``xp=`` arguments accept.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> xp = aa.array_namespace(np)            # a library
        >>> xp.asarray([1.0, 2.0]).dtype
        dtype('float64')
        >>> aa.array_namespace(np.ones(2), np.zeros(3)) is xp   # arrays
        True
    """
    if not arrays_or_library:
        raise TypeError("array_namespace needs arrays or one library module, got nothing")
    if len(arrays_or_library) == 1 and not array_api_compat.is_array_api_obj(arrays_or_library[0]):
        return resolve_namespace(arrays_or_library[0])
    return namespace_of(**{f"arrays[{i}]": x for i, x in enumerate(arrays_or_library)})


def device(x: Array) -> Any:
    """The device of array ``x`` (``array_api_compat.device``), for ``device=`` arguments.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> aa.device(np.ones(2))
        'cpu'
    """
    return device_of(x)


def _numpy_probe() -> Array:
    import numpy

    return numpy.empty(0)


def is_real_floating(xp: Namespace, dtype: Any) -> bool:
    """True for float16, bfloat16, float32, float64 (and other real floating dtypes)."""
    try:
        return _FLOATING[(id(xp), dtype)]
    except KeyError:
        pass
    except TypeError:  # an unhashable dtype object: ask every time
        return bool(xp.isdtype(dtype, "real floating"))
    result = bool(xp.isdtype(dtype, "real floating"))
    if len(_FLOATING) < _CACHE_LIMIT:
        _FLOATING[(id(xp), dtype)] = result
    return result


def compute_dtype(xp: Namespace, dtype: Any) -> Any:
    """The accumulation dtype for inputs of ``dtype``: float64 stays float64, every other
    floating dtype (float16, bfloat16, float32) computes in float32."""
    if dtype == xp.float64:
        return xp.float64
    return xp.float32


def lse_dtype(xp: Namespace, dtype: Any) -> Any:
    """The dtype of the log-sum-exp returned next to attention: float32, or float64 for
    float64 inputs."""
    return compute_dtype(xp, dtype)


def full_scalar(xp: Namespace, value: float, dtype: Any, device: Any) -> Array:
    """A 0-d array holding ``value``: strict array-API versions reject Python scalars in
    ``where``/``maximum``, so constants are wrapped."""
    return xp.asarray(value, dtype=dtype, device=device)


def exp_shifted(xp: Namespace, scratch: Array, shift: Array | None) -> Array:
    """``exp(scratch - shift)`` (``exp(scratch)`` when ``shift`` is ``None``), computed in
    ``scratch``'s own memory where the library allows it (NumPy, CuPy, PyTorch); elsewhere
    (JAX, Dask, others) a new array.

    ``scratch`` must be a temporary the caller owns and no longer needs (a block of
    scores just computed): it may be overwritten (never a PyTorch tensor that autograd
    records: its backward may need the scores as they were). Why: the array API has in-place
    operators but no in-place ``exp``, and the two new arrays that ``xp.exp(s - m)``
    allocates per block cost more than the arithmetic on CPU (each is a score-block-sized
    write to fresh memory, and freed blocks returned to the OS come back as page faults:
    ~84,000 per call for PyTorch with 64 x 2048 blocks of 8 heads). When ``shift``
    broadcasts ``scratch`` to a larger shape the result is a new array.

    Examples:
        >>> import numpy as np
        >>> s = np.array([[1.0, 2.0]])
        >>> exp_shifted(np, s, np.array([[2.0]]))
        array([[0.36787944, 1.        ]])
    """
    if shift is not None and broadcast_shapes(tuple(scratch.shape), tuple(shift.shape)) != tuple(
        scratch.shape
    ):
        return xp.exp(scratch - shift)  # the result is larger than the scratch
    if array_api_compat.is_torch_array(scratch) and not scratch.requires_grad:
        return (scratch if shift is None else scratch.sub_(shift)).exp_()
    ufuncs = _out_library(scratch)
    if ufuncs is not None:
        if shift is not None:
            ufuncs.subtract(scratch, shift, out=scratch)
        return ufuncs.exp(scratch, out=scratch)
    return xp.exp(scratch if shift is None else scratch - shift)


def where_allowed(xp: Namespace, scratch: Array, allowed: Array, fill: Array) -> Array:
    """``where(allowed, scratch, fill)``, written into ``scratch`` where the library allows
    it (NumPy, CuPy, PyTorch) and ``allowed`` broadcasts to it; elsewhere a new array.
    ``scratch`` must be a temporary the caller owns (a block of scores just computed);
    ``fill`` a 0-d array of its dtype. Why: see :func:`exp_shifted` (a score-sized
    allocation per masked block).

    Examples:
        >>> import numpy as np
        >>> s = np.array([[1.0, 2.0]])
        >>> where_allowed(np, s, np.array([True, False]), np.asarray(-np.inf))
        array([[  1., -inf]])
    """
    if broadcast_shapes(tuple(scratch.shape), tuple(allowed.shape)) != tuple(scratch.shape):
        return xp.where(allowed, scratch, fill)
    if array_api_compat.is_torch_array(scratch):
        if scratch.requires_grad:  # autograd may need the scores as they are
            return xp.where(allowed, scratch, fill)
        return scratch.masked_fill_(allowed.logical_not(), fill)
    lib = _out_library(scratch)
    if lib is None:
        return xp.where(allowed, scratch, fill)
    lib.copyto(scratch, fill, where=lib.logical_not(allowed))
    return scratch


def workspace(
    xp: Namespace, size: int, dtype: Any, device: Any, enabled: bool = True
) -> Array | None:
    """A flat scratch buffer of ``size`` elements for :func:`matmul_into`, or ``None``
    where the library's ``matmul`` takes no ``out=`` (or ``enabled`` is False: PyTorch
    autograd does not follow ``out=``). Why: a block loop that allocates a fresh
    score-sized product per block makes the allocator grow and trim its heap over and
    over, and every page it gets back faults on first touch (measured on PyTorch CPU
    tensors: 2,000-27,000 faults and up to 30% of a chunked call).

    Examples:
        >>> import numpy as np
        >>> workspace(np, 4, np.float32, "cpu").shape
        (4,)
    """
    if not enabled or size <= 0 or not writes_in_place(xp, dtype, device):
        return None
    return xp.empty((size,), dtype=dtype, device=device)


def writes_in_place(xp: Namespace, dtype: Any, device: Any) -> bool:
    """True when the library's new arrays of ``dtype`` on ``device`` can be written
    through a view (NumPy, CuPy, PyTorch): :func:`where_allowed` then masks a slice of a
    block in place. The caller rules out PyTorch tensors that autograd records.

    Examples:
        >>> import numpy as np
        >>> writes_in_place(np, np.float32, "cpu")
        True
    """
    probe = xp.empty((0,), dtype=dtype, device=device)
    return array_api_compat.is_torch_array(probe) or _out_library(probe) is not None


def rowwise_dot(xp: Namespace, a: Array, b: Array) -> Array:
    """``sum(a * b, axis=-1)``: the backward's ``D = rowsum(dO * O)``, shape
    ``a.shape[:-1]``. NumPy arrays take ``einsum``, as the NumPy fast path does (no
    ``a * b`` temporary, and the same rounding in every path that computes ``D``, so the
    Dask path's per-row ``D`` is the one its blocks would compute); other libraries
    multiply and sum.

    Examples:
        >>> import numpy as np
        >>> rowwise_dot(np, np.ones((2, 3)), np.full((2, 3), 2.0))
        array([6., 6.])
    """
    if array_api_compat.is_numpy_array(a) and array_api_compat.is_numpy_array(b):
        import numpy as np

        return np.einsum("...d,...d->...", a, b)
    return xp.sum(a * b, axis=-1)


def row_sums_by_product(xp: Namespace) -> bool:
    """Whether the softmax's row sums should come out of the ``P @ V`` product as a
    column of ones appended to ``V`` (True) or from a separate ``sum`` (False). Why:
    PyTorch's CPU ``bmm`` loses 15% on an odd width (8 heads x 256 x 512 @ 512 x 65:
    0.82 ms against 0.70 for 64 columns) while its row ``sum`` of the block takes 0.07
    ms; NumPy's OpenBLAS loses 0.05 ms on the extra column and its ``sum`` takes 0.16
    (2-core VM, float32, 2026-11-23). Other libraries keep the column (unmeasured).

    Examples:
        >>> import numpy as np
        >>> row_sums_by_product(np)
        True
    """
    return library_name(xp) != "torch"


def _out_library(x: Array) -> Any:
    """NumPy or CuPy when ``x`` is one of their arrays that may be written, else
    ``None``: their functions write results into an array the caller names (``out=``,
    ``copyto(where=)``), which the array API has no way to ask for."""
    if array_api_compat.is_numpy_array(x):
        if not x.flags.writeable:
            return None
        import numpy

        return numpy
    if array_api_compat.is_cupy_array(x):
        import cupy

        return cupy
    return None


def matmul_into(xp: Namespace, a: Array, b: Array, scratch: Array | None) -> Array:
    """``a @ b``, written into the front of ``scratch`` (a :func:`workspace`) when it is
    given and large enough; else a new array. The result is valid until the caller
    writes to ``scratch`` again.

    Examples:
        >>> import numpy as np
        >>> ws = workspace(np, 8, np.float64, "cpu")
        >>> matmul_into(np, np.ones((2, 3)), np.ones((3, 2)), ws)
        array([[3., 3.],
               [3., 3.]])
    """
    if scratch is None or a.dtype != scratch.dtype or b.dtype != scratch.dtype:
        return xp.matmul(a, b)
    shape = broadcast_shapes(tuple(a.shape[:-2]), tuple(b.shape[:-2])) + (
        int(a.shape[-2]),
        int(b.shape[-1]),
    )
    n = prod(shape)
    if n > int(scratch.shape[0]):
        return xp.matmul(a, b)
    out = xp.reshape(scratch[:n], shape)
    if array_api_compat.is_torch_array(out):
        import torch

        return torch.matmul(a, b, out=out)
    lib = _out_library(out)
    return xp.matmul(a, b) if lib is None else lib.matmul(a, b, out=out)


class NumpyBridge:
    """Zero-copy NumPy views of another library's CPU arrays, and back (see
    :func:`numpy_bridge`). Only PyTorch CPU tensors have one today."""

    def __init__(self, library: Any) -> None:
        self._torch = library

    def dtype(self, dtype: Any) -> Any:
        """The NumPy dtype for the library's ``dtype``, or ``None`` when NumPy has none
        (``torch.bfloat16``)."""
        import numpy

        torch = self._torch
        table = {
            torch.float16: numpy.float16,
            torch.float32: numpy.float32,
            torch.float64: numpy.float64,
        }
        found = table.get(dtype)
        return None if found is None else numpy.dtype(found)

    def to_numpy(self, x: Array | None) -> Any:
        """A NumPy view of ``x``'s memory (no copy; a tensor that requires grad is
        detached first: arrayattn's gradients are its own)."""
        if x is None:
            return None
        return x.detach().resolve_conj().resolve_neg().numpy()

    def from_numpy(self, a: Any) -> Array:
        """A tensor sharing ``a``'s memory (a read-only NumPy result is copied first)."""
        if a is None:
            return None
        if not a.flags.writeable:
            a = a.copy()
        return self._torch.from_numpy(a)


def numpy_bridge(xp: Namespace, device: Any) -> NumpyBridge | None:
    """A :class:`NumpyBridge` when arrays of ``xp`` on ``device`` can be viewed as NumPy
    arrays without a copy (PyTorch tensors on the CPU), else ``None``. NumPy code (the
    fast path) can then run on them directly: the data stays where it is.

    Examples:
        >>> import numpy as np
        >>> numpy_bridge(resolve_namespace(np), "cpu") is None  # NumPy needs no bridge
        True
    """
    if not array_api_compat.is_torch_namespace(xp):
        return None
    if getattr(device, "type", device) != "cpu":
        return None
    import torch

    return NumpyBridge(torch)


class CupyBridge:
    """Zero-copy CuPy views of another library's GPU arrays through DLPack, and back (see
    :func:`cupy_bridge`): PyTorch CUDA tensors and JAX GPU arrays. bfloat16, which CuPy
    has no dtype for, travels as its 16-bit storage viewed as int16 (the kernels read the
    bits); JAX has no zero-copy bit view, so a JAX bfloat16 array is bit-cast on the GPU
    (one copy each way)."""

    KINDS = ("float16", "bfloat16", "float32", "float64")

    def __init__(self, library: str) -> None:
        self.library = library  # "torch" or "jax"

    def kind(self, dtype: Any) -> str | None:
        """``"float16"``, ``"bfloat16"``, ``"float32"``, ``"float64"`` for the library's
        ``dtype``, else ``None``."""
        name = str(dtype).removeprefix("torch.")
        return name if name in self.KINDS else None

    def to_cupy(self, x: Array | None, as_float32: bool = False) -> Any:
        """A CuPy view of ``x`` (no copy; bfloat16 as int16 storage). ``as_float32``
        converts a floating ``x`` to float32 in its own library first (a copy: for small
        per-head arrays and masks the kernels read in float32)."""
        if x is None:
            return None
        import cupy

        if self.library == "torch":
            import torch

            x = x.detach()
            if as_float32 and x.is_floating_point():
                x = x.float()
            if x.dtype == torch.bfloat16:
                x = x.view(torch.int16)
            return cupy.from_dlpack(x)
        import jax.numpy as jnp

        if as_float32 and jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(jnp.float32)
        if x.dtype == jnp.bfloat16:
            import jax

            x = jax.lax.bitcast_convert_type(x, jnp.int16)
        return cupy.from_dlpack(x)

    def from_cupy(self, a: Any, kind: str | None = None) -> Array:
        """``a`` as an array of the library (no copy); ``kind="bfloat16"`` reads int16
        storage as bfloat16."""
        if a is None:
            return None
        if self.library == "torch":
            import torch

            t = torch.from_dlpack(a)
            return t.view(torch.bfloat16) if kind == "bfloat16" else t
        import jax
        import jax.numpy as jnp

        x = jnp.from_dlpack(a)
        return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if kind == "bfloat16" else x


def cupy_bridge(xp: Namespace, device: Any, *arrays: Array | None) -> CupyBridge | None:
    """A :class:`CupyBridge` when arrays of ``xp`` on ``device`` can be handed to CuPy
    through DLPack (PyTorch tensors on a CUDA device; JAX arrays on a GPU, outside
    tracing) and CuPy is installed, else ``None``. ``arrays``: the call's arrays (JAX
    tracers have no memory to hand over).

    Examples:
        >>> import numpy as np
        >>> cupy_bridge(resolve_namespace(np), "cpu") is None  # NumPy: no GPU memory
        True
    """
    if array_api_compat.is_torch_namespace(xp):
        if getattr(device, "type", None) != "cuda":
            return None
        library = "torch"
    elif array_api_compat.is_jax_namespace(xp):
        if getattr(device, "platform", None) != "gpu":
            return None
        import jax

        if any(isinstance(a, jax.core.Tracer) for a in arrays if a is not None):
            return None
        library = "jax"
    else:
        return None
    return CupyBridge(library) if importlib.util.find_spec("cupy") is not None else None


def records_gradients(*arrays: Array | None) -> bool:
    """True when the arrays' library records operations on any of them for its own
    autograd: a PyTorch tensor that requires grad while grad mode is on.

    Examples:
        >>> import numpy as np
        >>> records_gradients(np.ones(2), None)
        False
    """
    for x in arrays:
        if x is not None and array_api_compat.is_torch_array(x) and x.requires_grad:
            import torch

            return bool(torch.is_grad_enabled())
    return False


def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...]:
    """NumPy broadcasting of shapes, without touching any array. Raises ``ValueError``."""
    if shapes and all(type(d) is int for d in shapes[0]):
        first = tuple(shapes[0])
        if all(tuple(s) == first for s in shapes[1:]):  # equal shapes: nothing to do
            return first
    ndim = max((len(s) for s in shapes), default=0)
    out = []
    for axis in range(ndim):
        size = 1
        for s in shapes:
            k = axis - (ndim - len(s))
            if k < 0:
                continue
            d = int(s[k])
            if d == 1:
                continue
            if size not in (1, d):
                raise ValueError(f"shapes {[tuple(s) for s in shapes]} do not broadcast")
            size = d
        out.append(size)
    return tuple(out)


def sum_to_shape(xp: Namespace, x: Array, shape: Sequence[int]) -> Array:
    """Sum ``x`` over the axes that broadcasting added or stretched, so that the result
    has ``shape`` (the adjoint of broadcasting)."""
    shape = tuple(int(d) for d in shape)
    extra = x.ndim - len(shape)
    if extra > 0:
        x = xp.sum(x, axis=tuple(range(extra)))
    stretched = tuple(axis for axis, d in enumerate(shape) if d == 1 and x.shape[axis] != 1)
    if stretched:
        x = xp.sum(x, axis=stretched, keepdims=True)
    if tuple(x.shape) != shape:
        x = xp.reshape(x, shape)
    return x


def prod(shape: Sequence[int]) -> int:
    """Product of a shape's sizes (1 for ``()``)."""
    return math.prod(int(d) for d in shape)


# -- memory --------------------------------------------------------------------------------
def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup's "max" means no limit


def _host_available_bytes() -> int | None:
    """Bytes of host memory a new allocation can take now: Linux's ``MemAvailable``,
    lowered to the room left under this process's cgroup (v2) limit when there is one;
    ``None`` where neither can be read (not Linux)."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    limit = _read_int("/sys/fs/cgroup/memory.max")
    used = _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None:
        found.append(max(0, limit - used))
    return min(found) if found else None


def physical_memory() -> int | None:
    """The machine's physical memory in bytes, or ``None`` where the OS does not say: the
    most any host buffer can ever hold (:func:`available_memory` is what can be allocated
    now)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def in_host_memory(xp: Namespace, device: Any) -> bool:
    """Whether arrays of ``xp`` on ``device`` live in host memory: on the library's default
    device (``device=None``) NumPy, Dask (whose chunks are host arrays) and
    array-api-strict; else a device whose type or platform names the CPU.

    Examples:
        >>> import numpy as np
        >>> in_host_memory(np, None), in_host_memory(np, "cuda:0")
        (True, False)
    """
    if device is None:  # the library's default device
        return bool(
            array_api_compat.is_numpy_namespace(xp)
            or array_api_compat.is_dask_namespace(xp)
            or array_api_compat.is_array_api_strict_namespace(xp)
        )
    kind = getattr(device, "platform", None) or getattr(device, "type", None) or device
    return "cpu" in str(kind).lower()


def available_memory(xp: Namespace, device: Any) -> int | None:
    """Bytes that arrays of ``xp`` on ``device`` can still allocate, when the library
    keeps them in host memory (NumPy, array-api-strict, PyTorch and JAX on the CPU);
    ``None`` when unknown: GPU memory (the library's own allocator reports it), Dask
    (its chunks are computed elsewhere, later) or a platform without ``/proc/meminfo``.

    Paths that would allocate more than this check first and raise a ``MemoryError``
    naming the sizes, instead of allocating (with Linux's overcommit, an allocation the
    machine cannot back may succeed and the process is killed when it touches it).

    Examples:
        >>> import numpy as np
        >>> n = available_memory(resolve_namespace(np), "cpu")
        >>> n is None or n > 0
        True
    """
    name = library_name(xp)
    if name in ("numpy", "array_api_strict"):
        return _host_available_bytes()
    if name in ("torch", "jax"):
        kind = getattr(device, "type", None) or getattr(device, "platform", None) or device
        if str(kind).lower() == "cpu":
            return _host_available_bytes()
    return None
