"""`poolctl`: the researcher's command line (filled in with the wire protocol)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    print("poolctl: not built yet in this version", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
