"""``python -m sbp`` (and the ``sbp`` console script): the command line of `sbp.tools.cli`."""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from .tools.cli import main as _main


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``sbp`` with `argv` (default: ``sys.argv[1:]``) and return the exit status.

    >>> main(["plan", "--mesh", "2x2", "--shape", "8x8", "--src", "S0,S1", "--dst", "B,B", "--json"]) == 0
    ... # doctest: +ELLIPSIS
    {"global_shape": [8, 8], ...}
    True
    """
    try:
        return _main(argv)
    except BrokenPipeError:   # the reader left (``sbp plan ... | head``): no traceback, and none at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
