"""The ``fxinit`` command (trace | show | viz | materialize) — reserved; not built yet."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("fxinit: the command-line interface is not available yet; use the Python API "
          "(python -m fxinit.demo shows it).", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
