"""arrayattn's attention as a ``torch.autograd.Function``: PyTorch's autograd calls
arrayattn's own backward (FlashAttention-2 from the saved LSE, ``O(L)`` memory, the sinks'
and a float mask's gradients, dropout regenerated from its seed) instead of
differentiating through the operations of the forward.

The forward saves the inputs, the output and the LSE, never the ``L x S`` weights; the
backward is the one :func:`arrayattn.vjp` runs (``impl.backward`` of the implementation
the forward used, and :func:`arrayattn.attention.composed.sinks_gradient`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import FunctionCtx

from ..attention import composed as _composed
from ..attention.block_mask import BlockMask
from ..attention.registry import select
from ..attention.spec import AttentionSpec, make_spec
from ..ops import attention as _ops_attention  # noqa: F401  (registers the implementations)
from ._call import check_no_grad_wanted, check_tensors, draw_torch_seed, route
from ._flex import prepare_flex
from ._tensors import Arrays

__all__ = ["scaled_dot_product_attention", "AttentionFunction", "Plan"]


@dataclass(frozen=True)
class Plan:
    """A validated call: how its tensors reach the implementation (``arrays``), its spec
    (built on those arrays: NumPy views or detached tensors, so that no path declines
    for autograd's sake) and the implementation whose forward and backward run it."""

    arrays: Arrays
    spec: AttentionSpec
    impl: Any

    def forward(self, *inputs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of ``(query, key, value, attn_mask)``, as tensors."""
        a = self.arrays
        out, lse = self.impl.forward(self.spec, *map(a.to_backend, inputs))
        return a.to_torch(out), a.to_torch(lse)


class AttentionFunction(torch.autograd.Function):
    """``apply(plan, query, key, value, attn_mask, sinks, *score_params) -> (out, lse)``.

    Differentiable inputs: ``query``, ``key``, ``value``, a float ``attn_mask``,
    ``sinks`` and the ``params`` of a ``score_mod`` (a bias table: ``score_params``, in
    order; the plan's spec holds the score_mod over their backend arrays); the rest of
    the call lives in ``plan``. Both outputs take gradients
    (``d_lse`` flows when the caller returns the LSE). Saved for the backward: the
    inputs, ``out`` and ``lse``. Double backward (``create_graph=True``) raises."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        plan: Plan,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        sinks: torch.Tensor | None,
        *score_params: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = plan.forward(query, key, value, attn_mask)
        ctx.plan = plan  # type: ignore[attr-defined]
        # Unused outputs (the LSE of a caller that drops it) reach backward as None, not
        # as zeros to multiply through.
        ctx.set_materialize_grads(False)
        saved: tuple[Any, ...] = (query, key, value, attn_mask, sinks, out, lse)  # None allowed
        ctx.save_for_backward(*saved, *score_params)
        return out, lse

    @staticmethod
    def backward(
        ctx: Any, d_out: torch.Tensor | None, d_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        # Grad mode is on in a backward only under create_graph=True. Refused there:
        # once_differentiable would return gradients that are silently constants when the
        # cotangents are (a gradient penalty on dq would then add nothing to the loss).
        if torch.is_grad_enabled():
            raise RuntimeError(
                "arrayattn.torch.scaled_dot_product_attention cannot be differentiated "
                "twice: its backward (create_graph=True) is arrayattn's own and has no "
                "backward of its own; use torch.nn.functional.scaled_dot_product_attention "
                "for higher-order gradients"
            )
        plan: Plan = ctx.plan
        query, key, value, attn_mask, sinks, out, lse, *score_params = ctx.saved_tensors
        # plan, query, key, value, attn_mask, sinks, *score_params
        _, *needs = ctx.needs_input_grad
        if d_out is None and d_lse is None:
            return (None,) * (6 + len(score_params))
        # Autograd's cotangents may be broadcast views (stride 0, from out.sum()); the
        # kernels and the fast path read dense rows.
        a = plan.arrays
        do = None if d_out is None else a.to_backend(d_out.contiguous())
        dl = None if d_lse is None else a.to_backend(d_lse.contiguous())
        grads: list[torch.Tensor | None] = [None] * 4
        if any(needs[:4]):
            inputs = (query, key, value, attn_mask)
            arrays = map(a.to_backend, (*inputs, out, lse))
            results = plan.impl.backward(plan.spec, *arrays, do, dl)
            grads = [a.to_torch(g, x) for g, x in zip(results, inputs, strict=True)]
        d_sinks = None
        if needs[4]:
            # A row statistic, the same for every implementation (as in arrayattn.vjp).
            out_lse = a.to_backend(out), a.to_backend(lse)
            d_sinks = a.to_torch(_composed.sinks_gradient(plan.spec, *out_lse, do, dl), sinks)
        wanted = [g if need else None for g, need in zip(grads, needs, strict=False)]
        d_params: list[torch.Tensor | None] = [None] * len(score_params)
        if any(needs[5:]):
            # The score_mod's parameters (a bias table): one deterministic pass over the
            # scores, the same on every implementation (as in arrayattn.vjp).
            qb, kb, vb, mb, ob, lb = map(a.to_backend, (query, key, value, attn_mask, out, lse))
            got = _composed.score_mod_param_grads(plan.spec, qb, kb, vb, mb, ob, lb, do, dl)
            d_params = [
                a.to_torch(g, p) if need else None
                for g, p, need in zip(got, score_params, needs[5:], strict=True)
            ]
        return (None, *wanted, d_sinks, *d_params)


# torch.compile: dynamo does not trace this function (a graph break): the call runs
# eagerly and autograd calls AttentionFunction.backward as in eager mode. Chosen over
# torch.library.custom_op + register_autograd (no break), which needs a second custom op
# for the backward (AOTAutograd traces the registered backward, and ours calls NumPy),
# fake shape functions for both, and every option (window pairs, the implementation, a
# seed drawn from PyTorch's generator) squeezed through an operator schema: code paths
# that differ between eager and compiled calls. Here there is one path, correct under
# every backend (eager, aot_eager and inductor tried), for one break per call.
@torch.compiler.disable
def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_align: str = "top_left",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    seed: int | None = None,
    return_lse: bool = False,
    implementation: str = "auto",
    q_lengths: torch.Tensor | None = None,
    kv_lengths: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,
    mask_mod: Any = None,
    score_mod: Any = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`arrayattn.scaled_dot_product_attention` on torch tensors, differentiated by
    PyTorch's autograd with arrayattn's own backward.

    Same arguments, names and semantics as :func:`arrayattn.scaled_dot_product_attention`
    (PyTorch's ``torch.nn.functional.scaled_dot_product_attention`` plus FlashAttention's
    options). Shapes: ``query (..., Hq, L, E)``, ``key (..., Hkv, S, E)``,
    ``value (..., Hkv, S, Ev)`` -> output ``(..., Hq, L, Ev)`` in the input dtype; with
    ``return_lse=True`` also the LSE ``(..., Hq, L)``, float32 (float64 for float64).

    Gradients (``loss.backward()``): ``query``, ``key``, ``value``, a float ``attn_mask``
    (in its own broadcast shape), ``sinks``, and through the returned LSE. A bool mask,
    the lengths and ``dropout_p``/``scale`` get none; ``alibi_slopes`` that require grad
    are a ``ValueError`` (arrayattn treats the slopes as constants). The graph keeps the
    inputs, the output and the LSE (never the ``L x S`` weights); double backward raises.

    Devices: CPU float32/float64/float16 run on the NumPy fast path over zero-copy views
    of the tensors; CPU bfloat16 on arrayattn's array-API paths in PyTorch operations;
    CUDA tensors on arrayattn's CUDA kernels through DLPack (CuPy needed; bfloat16
    included). With ``dropout_p > 0`` and ``seed=None`` the seed comes from PyTorch's
    default generator (``torch.manual_seed`` reproduces it). Under ``torch.compile`` the
    call is a graph break (it runs eagerly, forward and backward).

    Args:
        query: ``(..., Hq, L, E)``, a floating tensor (any strides: views are not copied).
        key: ``(..., Hkv, S, E)``, query's dtype and device.
        value: ``(..., Hkv, S, Ev)``, query's dtype and device.
        attn_mask: bool (``True`` = takes part) or float (added to the scores),
            broadcastable to ``(..., Hq, L, S)``; a float mask that requires grad gets one.
        dropout_p: probability in ``[0, 1)`` of dropping an attention probability.
        is_causal: causal mask, aligned by ``causal_align``.
        scale: score scale; default ``1 / sqrt(E)``.
        enable_gqa: query head ``h`` reads KV head ``h // (Hq // Hkv)``.
        causal_align: ``"top_left"`` (PyTorch) or ``"bottom_right"`` (FlashAttention).
        window: ``(left, right)`` sliding window around the aligned diagonal, ``-1``
            unbounded.
        softcap: ``softcap * tanh(scores / softcap)`` before masks.
        seed: dropout seed; ``None`` draws one from PyTorch's default generator.
        return_lse: also return the LSE (differentiable).
        implementation: ``"auto"`` or a name from :func:`arrayattn.implementations`.
        q_lengths: int tensor of the batch shape: valid queries per sequence.
        kv_lengths: int tensor of the batch shape: valid keys per sequence.
        sinks: attention-sink logits, ``(Hq,)`` or broadcastable to ``(..., Hq)``.
        alibi_slopes: ALiBi slopes, ``(Hq,)`` or ``(B, Hq)``; no gradient.
        block_mask: a :class:`~arrayattn.flex.BlockMask` for this call's ``(B, Hq, L,
            S)``: built with ``create_block_mask(..., xp=torch, device=query.device)``
            (the call then runs arrayattn's array-API paths in PyTorch operations), or,
            for CPU float16/32/64 tensors, with the default NumPy one (the NumPy fast
            path over views of the tensors). Another library or device is a
            ``ValueError`` naming both.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's), ANDed with
            every other mask; the same one as ``block_mask``'s, or alone. It is called on
            index arrays of the library the call runs on: torch when it holds torch
            tensors (document ids) or ``block_mask`` was built for torch, else NumPy for
            CPU float16/32/64 tensors.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` after softcap and
            ALiBi; a :class:`~arrayattn.flex.ScoreMod` with its derivative when an input
            requires grad. Its ``params`` (a bias table, e.g.
            ``relative_position_bias(table)``) must be torch tensors on query's device;
            those that require grad get their gradient through autograd.

    Structured calls (``block_mask``/``mask_mod``/``score_mod``) are FlexAttention's
    ``flex_attention(q, k, v, score_mod=, block_mask=)`` with arrayattn's backward, which
    also runs on the CPU. A combination that needs both libraries (a NumPy block mask and
    a mask_mod holding torch tensors) is a ``TypeError``; a score_mod without a
    derivative is a ``TypeError`` when an input requires grad. On CUDA tensors they run
    the array-API paths (the fused kernels take block masks on CuPy arrays only).

    Returns:
        ``out``, or ``(out, lse)`` with ``return_lse=True``.

    Examples:
        >>> import torch
        >>> import arrayattn.torch as aat
        >>> g = torch.Generator().manual_seed(0)
        >>> q = torch.randn(2, 8, 16, 32, generator=g, requires_grad=True)
        >>> kv = torch.randn(2, 2, 16, 32, generator=g, requires_grad=True)
        >>> out = aat.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        >>> out.shape, out.grad_fn.name()
        (torch.Size([2, 8, 16, 32]), 'AttentionFunctionBackward')
        >>> out.square().sum().backward()
        >>> q.grad.shape, kv.grad.shape
        (torch.Size([2, 8, 16, 32]), torch.Size([2, 2, 16, 32]))
        >>> ref = torch.nn.functional.scaled_dot_product_attention(
        ...     q, kv, kv, is_causal=True, enable_gqa=True)
        >>> bool(torch.allclose(out, ref, atol=1e-5))
        True

        A document mask and a learned T5 bias table (its gradient through autograd):

        >>> from arrayattn.flex import create_block_mask, document_mask, relative_position_bias
        >>> ids = torch.arange(16) // 6                       # three packed documents
        >>> bm = create_block_mask(document_mask(ids), None, None, 16, 16, xp=torch,
        ...                        block_size=4)
        >>> table = torch.zeros(32, 8, requires_grad=True)    # (num_buckets, Hq)
        >>> out = aat.scaled_dot_product_attention(
        ...     q, kv, kv, enable_gqa=True, block_mask=bm,
        ...     score_mod=relative_position_bias(table))
        >>> out.sum().backward()
        >>> table.grad.shape
        torch.Size([32, 8])
    """
    check_tensors(
        query=query,
        key=key,
        value=value,
        attn_mask=attn_mask,
        q_lengths=q_lengths,
        kv_lengths=kv_lengths,
        sinks=sinks,
        alibi_slopes=alibi_slopes,
    )
    check_no_grad_wanted(alibi_slopes=alibi_slopes)
    flex = prepare_flex(query, block_mask, mask_mod, score_mod)
    score_params = () if flex is None else flex.params
    differentiable = (query, key, value, attn_mask, sinks, *score_params)
    grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in differentiable
    )
    if grad and flex is not None and flex.score_mod is not None:
        if not flex.score_mod.differentiable:
            raise TypeError(
                f"score_mod {flex.score_mod!r} has no derivative, so its backward cannot run "
                "(an input requires grad): wrap it as arrayattn.flex.ScoreMod(fn, "
                "grad=d_fn_d_score), or call under torch.no_grad()"
            )
    arrays = Arrays(query, numpy=None if flex is None else flex.numpy)
    to_backend = arrays.to_backend
    flex_options: dict[str, Any] = {}
    if flex is not None:
        flex_options = {
            "block_mask": flex.block_mask,
            "mask_mod": flex.mask_mod,
            "score_mod": flex.backend_score_mod(arrays),
        }
    spec = make_spec(
        to_backend(query),
        to_backend(key),
        to_backend(value),
        to_backend(attn_mask),
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        causal_align,
        window,
        softcap,
        draw_torch_seed(dropout_p, seed),
        q_lengths=to_backend(q_lengths),
        kv_lengths=to_backend(kv_lengths),
        sinks=to_backend(sinks),
        alibi_slopes=to_backend(alibi_slopes),
        lse_wanted=grad or return_lse,
        **flex_options,
    )
    plan = Plan(arrays, spec, select(spec, route(spec, implementation)))
    if grad:
        out, lse = AttentionFunction.apply(plan, query, key, value, attn_mask, sinks, *score_params)
    else:  # no graph to build: nothing saved, no Function node
        out, lse = plan.forward(query, key, value, attn_mask)
    return (out, lse) if return_lse else out
