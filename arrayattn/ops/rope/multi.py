"""Multi-axis RoPE: positions with one column per axis (frame, height, width, ...).

Two conventions exist in the wild and both are built here as the complex factors that
``apply_rope`` takes (either layout):

- independent ladders over a split of the head dim (Wan2.1's 3D RoPE, FLUX's
  ``axes_dim``): axis ``a`` owns ``axes_dim[a]`` consecutive real features and has its own
  ladder ``theta ** (-2j / axes_dim[a])``;
- Qwen2-VL's M-RoPE: one ladder over the whole head dim, whose frequencies are split in
  sections (``mrope_section``, counted in frequencies); frequency ``j`` reads the position
  of its section's axis (Qwen3-VL interleaves the sections instead).

Both reduce to "frequency ``j`` reads axis ``axis_of[j]`` and has inverse frequency
``inv_freq[j]``". The position each frequency reads is picked by masking, which is exact
and needs no gather (absent from the standard).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from ..._backend import Array, device_of, namespace_of, resolve_namespace
from .core import polar
from .scaling import inv_freq_list, real_dtype

__all__ = [
    "multi_axis_rope_frequencies",
    "mrope_frequencies",
    "grid_positions",
    "wan_axes_dim",
]


def _int_list(name: str, values: Any, *, even: bool) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise ValueError(f"{name} must be a non-empty sequence of ints, got {values!r}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0 or (even and v % 2):
            kind = "non-negative even ints" if even else "non-negative ints"
            raise ValueError(f"{name} must hold {kind}, got {list(values)!r}")
        out.append(int(v))
    if sum(out) == 0:
        raise ValueError(f"{name} must not be all zeros, got {out}")
    return out


def _check_positions(positions: Array, n_axes: int, what: str) -> tuple[Any, Any]:
    xp = namespace_of(positions=positions)
    if positions.ndim < 1 or int(positions.shape[-1]) != n_axes:
        raise ValueError(
            f"positions must have one column per axis, shape (..., N, {n_axes}) for {what}; "
            f"got shape {tuple(positions.shape)}"
        )
    if xp.isdtype(positions.dtype, "bool") or xp.isdtype(positions.dtype, "complex floating"):
        raise TypeError(f"positions must be integer or real floating, got dtype {positions.dtype}")
    return xp, device_of(positions)


def _angles(
    xp: Any, positions: Array, axis_of: list[int], inv_freq: list[float], real: Any, device: Any
) -> Array:
    """``angles[..., j] = positions[..., axis_of[j]] * inv_freq[j]``, without a gather.

    Each axis contributes ``positions[..., a] * w_a`` where ``w_a`` is ``inv_freq`` on
    that axis's frequencies and 0 elsewhere; adding exact zeros keeps every angle the one
    product ``pos * inv_freq``. (Elementwise on purpose: a matmul with a 0/1 matrix would
    be exact too, but some backends run float32 matmuls in TF32 on GPUs.)"""
    pos = xp.astype(positions, real)
    angles = None
    for a in range(int(positions.shape[-1])):
        w = [f if axis == a else 0.0 for f, axis in zip(inv_freq, axis_of, strict=True)]
        if not any(w):
            continue
        term = pos[..., a : a + 1] * xp.asarray(w, dtype=real, device=device)
        angles = term if angles is None else angles + term
    return angles


def multi_axis_rope_frequencies(
    axes_dim: Sequence[int],
    positions: Array,
    *,
    theta: float | Sequence[float] = 10000.0,
    dtype: Any = None,
) -> Array:
    """RoPE with an independent ladder per axis over a split of the head dim (Wan2.1 3D,
    FLUX ``EmbedND``).

    Axis ``a`` rotates ``axes_dim[a]`` consecutive real features (``axes_dim[a] / 2``
    pairs) with its own ladder: pair ``j`` of axis ``a`` turns by
    ``positions[..., a] * theta_a ** (-2j / axes_dim[a])``. The frequencies of axis 0
    come first, then axis 1's, and so on, so with ``layout="interleaved"`` axis ``a`` owns
    real features ``[sum(axes_dim[:a]), sum(axes_dim[:a+1]))`` exactly as Wan2.1's
    ``rope_apply`` and FLUX's ``apply_rope`` do. With ``layout="half"`` the same pairs are
    ``(j, j + F)``.

    Shapes: ``positions`` ``(..., N, A)`` (integer or real; one column per axis, e.g. from
    :func:`grid_positions`) -> complex ``(..., N, sum(axes_dim) // 2)``. For
    ``x`` ``(B, H, N, D)`` with per-sample positions ``(B, N, A)``, pass
    ``freqs[:, None]``. ``sum(axes_dim) < D`` leaves the remaining features unrotated.

    Args:
        axes_dim: real features per axis, each even; Wan2.1 uses :func:`wan_axes_dim`,
            FLUX ``(16, 56, 56)``.
        positions: the per-token positions.
        theta: the base, one for all axes or one per axis.
        dtype: the real dtype of the angles (float32 default -> complex64; float64 ->
            complex128, as Wan2.1's ``rope_params``).

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> pos = aa.grid_positions((2, 3, 4), xp=np)            # (F*H*W, 3)
        >>> f = aa.multi_axis_rope_frequencies(aa.wan_axes_dim(12), pos)
        >>> pos.shape, f.shape, aa.wan_axes_dim(12)
        ((24, 3), (24, 6), (4, 4, 4))
        >>> x = np.ones((1, 2, 24, 12), dtype=np.float32)         # (B, H, F*H*W, D)
        >>> aa.apply_rope(x, f).shape
        (1, 2, 24, 12)
    """
    dims = _int_list("axes_dim", axes_dim, even=True)
    thetas = list(theta) if isinstance(theta, Sequence) else [theta] * len(dims)
    if len(thetas) != len(dims):
        raise ValueError(
            f"theta must be one number or one per axis ({len(dims)}), got {len(thetas)}: {theta!r}"
        )
    xp, device = _check_positions(positions, len(dims), f"axes_dim={dims}")
    axis_of: list[int] = []
    inv_freq: list[float] = []
    for a, (d, t) in enumerate(zip(dims, thetas, strict=True)):
        if d == 0:
            continue
        ladder, _ = inv_freq_list(d, None, theta=t)
        inv_freq += ladder
        axis_of += [a] * len(ladder)
    real = real_dtype(xp, dtype)
    return polar(xp, _angles(xp, positions, axis_of, inv_freq, real, device))


def mrope_frequencies(
    head_dim: int,
    positions: Array,
    mrope_section: Sequence[int] | None = None,
    *,
    interleaved: bool | None = None,
    theta: float = 10000.0,
    rope_scaling: Mapping[str, Any] | None = None,
    partial_rotary_factor: float | None = None,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
    apply_attention_factor: bool = True,
    dtype: Any = None,
) -> Array:
    """Qwen2-VL's multimodal RoPE (M-RoPE): one ladder, a position per section.

    The ladder is :func:`rope_frequencies`'s for ``head_dim`` (and ``rope_scaling``, if
    any). Its ``head_dim // 2`` frequencies are split into ``len(mrope_section)``
    consecutive sections of ``mrope_section[a]`` frequencies (Qwen2-VL/Qwen2.5-VL:
    ``[16, 24, 24]`` for temporal, height, width); frequency ``j`` of section ``a`` turns
    by ``positions[..., a] * inv_freq_j``. ``interleaved=True`` is Qwen3-VL's layout:
    frequency ``j`` reads axis ``j % 3`` while ``j < 3 * mrope_section[j % 3]`` and axis 0
    otherwise. Hugging Face applies M-RoPE in the ``"half"`` layout (``rotate_half``).

    Shapes: ``positions`` ``(..., N, A)`` with ``A = len(mrope_section)`` (Hugging Face's
    ``position_ids`` of shape ``(3, B, N)`` is ``moveaxis(position_ids, 0, -1)``); text
    tokens have the same position in every column -> complex ``(..., N, head_dim // 2)``.

    Args:
        head_dim: the head dim ``D``; ``sum(mrope_section)`` must be ``D // 2`` (with
            ``partial_rotary_factor``: half the rotated features).
        positions: the per-token positions, one column per section.
        mrope_section: frequencies per section; default: ``rope_scaling["mrope_section"]``
            (where Qwen2-VL's config keeps it).
        interleaved: Qwen3-VL's interleaved sections; default:
            ``rope_scaling["mrope_interleaved"]``, else False.
        theta, rope_scaling, partial_rotary_factor: as in :func:`rope_frequencies`, so
            that ``mrope_frequencies(positions=..., **rope_kwargs_from_config(config))``
            works.
        max_position_embeddings, seq_len, apply_attention_factor: as in
            :func:`rope_frequencies` (``seq_len`` is needed by ``dynamic`` and
            ``longrope``).
        dtype: the real dtype of the angles (float32 default -> complex64).

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> pos = np.stack([np.arange(6)] * 3, axis=-1)        # text: t = h = w
        >>> f = aa.mrope_frequencies(16, pos, [2, 3, 3])
        >>> bool(np.allclose(f, aa.rope_frequencies(16, 6, xp=np)))
        True
    """
    if mrope_section is None or interleaved is None:
        if rope_scaling is not None and not isinstance(rope_scaling, Mapping):
            raise TypeError(
                f"rope_scaling must be a dict or None, got {type(rope_scaling).__name__}"
            )
        config = rope_scaling or {}
        if mrope_section is None:
            mrope_section = config.get("mrope_section")
            if mrope_section is None:
                raise ValueError("mrope_section is needed (not given, and not in rope_scaling)")
        if interleaved is None:
            interleaved = bool(config.get("mrope_interleaved", False))
    sections = _int_list("mrope_section", mrope_section, even=False)
    if isinstance(head_dim, bool) or not isinstance(head_dim, numbers.Integral):
        raise ValueError(f"head_dim must be an even int >= 2, got {head_dim!r}")
    if partial_rotary_factor is None and sum(sections) != int(head_dim) // 2:
        raise ValueError(
            f"mrope_section {sections} must sum to head_dim // 2 = {int(head_dim) // 2} "
            f"(it counts frequencies, not features), got sum {sum(sections)}"
        )
    if interleaved and len(sections) != 3:
        raise ValueError(f"interleaved M-RoPE needs 3 sections, got mrope_section {sections}")
    xp, device = _check_positions(positions, len(sections), f"mrope_section={sections}")
    if rope_scaling is not None and seq_len is None:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if kind in ("dynamic", "longrope"):
            raise ValueError(
                f"rope_scaling of rope_type {kind!r} depends on the sequence length: pass "
                "seq_len= (Hugging Face uses max(position_ids) + 1)"
            )
    inv_freq, attention_factor = inv_freq_list(
        head_dim,
        rope_scaling,
        theta=theta,
        partial_rotary_factor=partial_rotary_factor,
        max_position_embeddings=max_position_embeddings,
        seq_len=seq_len,
    )
    if len(inv_freq) != sum(sections):
        raise ValueError(
            f"the ladder rotates {2 * len(inv_freq)} of {head_dim} features (partial "
            f"rotary), but mrope_section {sections} counts {sum(sections)} frequencies; "
            f"they must sum to {len(inv_freq)}"
        )
    if interleaved:
        axis_of = [j % 3 if j < 3 * sections[j % 3] else 0 for j in range(len(inv_freq))]
    else:
        axis_of = [a for a, n in enumerate(sections) for _ in range(n)]
    real = real_dtype(xp, dtype)
    angles = _angles(xp, positions, axis_of, inv_freq, real, device)
    return polar(xp, angles, attention_factor if apply_attention_factor else 1.0)


def grid_positions(
    grid: Sequence[int],
    *,
    offset: int | Sequence[int] = 0,
    xp: Any = None,
    device: Any = None,
    dtype: Any = None,
) -> Array:
    """Positions of every cell of a grid, one row per token in row-major order.

    For ``grid = (F, H, W)`` row ``(f * H + h) * W + w`` is ``(f, h, w)`` (plus
    ``offset``): the order of Wan2.1's patch tokens (``flatten(2)`` of ``(C, F, H, W)``)
    and of Qwen2-VL's vision tokens before merging. Any number of axes: ``(H, W)`` for
    images.

    Shapes: ``grid`` of ``A`` sizes -> ``(prod(grid), A)``.

    Args:
        grid: the size of each axis.
        offset: added to every position, one int or one per axis (e.g. the text length
            before an image in Qwen2-VL).
        xp, device: where to build it (default NumPy, CPU).
        dtype: an integer (or real) dtype; default ``int64``.

    Examples:
        >>> import numpy as np
        >>> import arrayattn as aa
        >>> aa.grid_positions((2, 1, 2), xp=np).tolist()
        [[0, 0, 0], [0, 0, 1], [1, 0, 0], [1, 0, 1]]
    """
    sizes = _int_list("grid", grid, even=False)
    offsets = list(offset) if isinstance(offset, Sequence) else [offset] * len(sizes)
    if len(offsets) != len(sizes) or any(
        isinstance(o, bool) or not isinstance(o, numbers.Integral) for o in offsets
    ):
        raise ValueError(f"offset must be an int or one int per axis of {sizes}, got {offset!r}")
    ns = resolve_namespace(xp)
    dt = ns.int64 if dtype is None else dtype
    columns = []
    for a, (n, o) in enumerate(zip(sizes, offsets, strict=True)):
        shape = tuple(n if b == a else 1 for b in range(len(sizes)))
        col = ns.reshape(ns.arange(int(o), int(o) + n, dtype=dt, device=device), shape)
        columns.append(ns.reshape(ns.broadcast_to(col, tuple(sizes)), (-1,)))
    return ns.stack(columns, axis=-1)


def wan_axes_dim(head_dim: int) -> tuple[int, int, int]:
    """Wan2.1's split of the head dim over (frame, height, width), in real features:
    ``(d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6))``.

    Examples:
        >>> import arrayattn as aa
        >>> aa.wan_axes_dim(128)
        (44, 42, 42)
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, numbers.Integral) or head_dim % 2:
        raise ValueError(f"head_dim must be an even int, got {head_dim!r}")
    d = int(head_dim)
    if d < 6:
        raise ValueError(f"head_dim must be >= 6 to split over three axes, got {d}")
    return (d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6))
