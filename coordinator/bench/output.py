"""Where a bench's result goes first, as its flags say: drawn to --plot's file, printed as one JSON
object with --json (the bench prints its own table otherwise)."""

from __future__ import annotations

import json
from typing import Callable


def emitted(out: dict, args, plot: Callable[[dict, str], None] | None = None) -> bool:
    """Draw `out` with `plot` where --plot names a file, and print it as JSON where --json asks.
    True: the JSON was the output, so the bench prints no table."""
    if plot is not None and args.plot:
        plot(out, args.plot)
    if args.json:
        print(json.dumps(out))
        return True
    return False
