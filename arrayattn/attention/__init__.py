"""Attention's machinery: one spec, a registry, and the implementations behind
:func:`arrayattn.scaled_dot_product_attention`.

A call flows: the public function (:mod:`arrayattn.ops.attention`) validates its
arguments into an :class:`~arrayattn.attention.spec.AttentionSpec` (:mod:`.spec`: shapes,
dtypes, the causal/window :mod:`.structure`, lengths, the :mod:`.dropout` seed), asks
the :mod:`.registry` for an implementation (named, or ``"auto"``: each registered one
declines what it cannot run and estimates its cost, :mod:`.cost`) and runs its
``forward``; :func:`arrayattn.vjp` keeps the spec and runs the same implementation's
``backward``. The implementations, each registering itself (:mod:`.implementations`
imports them all):

- :mod:`.composed`: exact softmax over row blocks, array-API operations only (the
  reference, any library);
- :mod:`.chunked`: FlashAttention's online softmax over key blocks, array-API operations;
- :mod:`.fast`: the NumPy fast path (threads, BLAS, in-place ufuncs; also PyTorch CPU
  tensors through zero-copy views);
- :mod:`.dask`: blockwise task graphs of the above per chunk, merged by LSE (:mod:`.merge`);
- :mod:`.cuda`: CUDA kernels of our own for CuPy arrays.

Shared by several of them: :mod:`.threads` (the NumPy paths' worker pool) and
:mod:`.static_shift` (the static softmax shift). Nothing here imports
:mod:`arrayattn.ops` or :mod:`arrayattn.nn`: the public layers sit on top.
"""
