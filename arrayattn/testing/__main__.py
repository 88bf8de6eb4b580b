"""``python -m arrayattn.testing --peer torch|jax|keras|arrayattn``: print the
conformance report of an installed peer's attention (``--json`` for JSON)."""

from __future__ import annotations

import argparse
import sys
import warnings

from .adapters import Adapter

PEERS = ("torch", "jax", "keras", "arrayattn")


def _adapter(peer: str, backend: str) -> Adapter:
    from . import adapters

    if peer == "torch":
        return adapters.torch_sdpa()
    if peer == "jax":
        return adapters.jax_dpa()
    if peer == "keras":
        return adapters.keras_dpa()
    return adapters.arrayattn_sdpa(backend)


def main(argv: list[str] | None = None) -> int:
    """Run the battery against ``--peer`` and print the report; exit status 0 when
    nothing failed, 1 on failures, 2 when the peer or hypothesis (which draws the calls)
    is not installed."""
    parser = argparse.ArgumentParser(prog="python -m arrayattn.testing", description=__doc__)
    parser.add_argument("--peer", choices=PEERS, required=True, help="whose attention to check")
    parser.add_argument("--examples", type=int, default=30, help="calls drawn per feature")
    parser.add_argument("--backend", default="numpy", help="backend for --peer arrayattn")
    parser.add_argument("--features", default=None, help="comma-separated rows (default: all)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    from ._check import require_hypothesis

    try:
        require_hypothesis()
    except ModuleNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        adapter = _adapter(args.peer, args.backend)
    except ImportError as exc:
        print(f"{args.peer} is not installed here ({exc}); nothing to check.", file=sys.stderr)
        return 2
    from ._check import check_attention

    features = None if args.features is None else [f.strip() for f in args.features.split(",")]
    with warnings.catch_warnings():
        # Overflow/NaN warnings are what some features provoke on purpose.
        warnings.simplefilter("ignore")
        report = check_attention(adapter=adapter, examples=args.examples, features=features)
    print(report.to_json() if args.json else report.table())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
