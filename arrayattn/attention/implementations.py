"""Every attention implementation, imported so that each registers itself with
:mod:`arrayattn.attention.registry`: the composed and chunked array-API paths, the NumPy
fast path, the Dask path (where Dask is installed) and the CuPy kernels (where CuPy is
installed; neither library is imported here)."""

from __future__ import annotations

from . import chunked, composed, cuda, dask, fast

__all__ = ["composed", "chunked", "fast", "dask", "cuda"]
