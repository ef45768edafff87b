"""``python -m reparam.bench``: forwards to the benchmark of the ``fedhetero`` package.

The benchmark needs a model zoo and a reference implementation to compare with, so it lives in
``fedhetero.bench_reparam`` (run as ``fedhetero bench reparam``); ``reparam`` itself depends on
torch only. This module imports nothing from ``fedhetero`` until :func:`main` runs, and :func:`main`
says what to install when ``fedhetero`` is not available.
"""

from __future__ import annotations

import sys
from typing import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None, prog: str = "python -m reparam.bench") -> int:
    """Run ``fedhetero.bench_reparam.main``; exit status 2 with a message when fedhetero is missing."""
    try:
        from fedhetero.bench_reparam import main as bench_main
    except ImportError as exc:
        print(
            f"{prog}: the reparam benchmark is part of the fedhetero package (fedhetero.bench_reparam), "
            f"which could not be imported ({exc}). Install the project (python -m pip install -e .) "
            "and run `fedhetero bench reparam`.",
            file=sys.stderr,
        )
        return 2
    return int(bench_main(argv, prog=prog) or 0)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
