"""Load progress per node as `up` prints it: bars on a terminal, a line per quarter otherwise."""

from __future__ import annotations

import sys
import time

from .cluster import Member
from .placement import fmt_bytes


class Progress:
    """Load progress per node: bars on a terminal, a line per quarter otherwise."""

    def __init__(self, names: list[str], stream=sys.stderr):
        self.stream = stream
        self.tty = stream.isatty()
        self.names = names
        self.state = {n: (0, 0) for n in names}
        self.quarter = {n: -1 for n in names}
        self.width = max(len(n) for n in names)
        self.drawn = False
        self.base = {
            n: (time.monotonic(), 0) for n in names
        }  # (time, bytes) a node's current phase counts from

    def _rate(self, name: str) -> str:
        """bytes/s and ETA of a node's current load phase (shipping, reading the shard)."""
        done, total = self.state[name]
        t0, done0 = self.base[name]
        elapsed = time.monotonic() - t0
        if done <= done0 or elapsed <= 0:
            return ""
        rate = (done - done0) / elapsed
        return f", {fmt_bytes(rate)}/s, ETA {max(total - done, 0) / rate:.1f}s"

    def update(self, m: Member) -> None:
        if (
            m.load_done < self.state[m.name][0]
        ):  # a new phase (shipping, then reading the shard) starts over
            self.base[m.name] = (time.monotonic(), m.load_done)
        self.state[m.name] = (m.load_done, m.load_total)
        if self.tty:
            self._draw()
            return
        done, total = self.state[m.name]
        q = int(4 * done / total) if total else 0
        if q != self.quarter[m.name]:
            self.quarter[m.name] = q
            print(
                f"loading {m.name}: {fmt_bytes(done)} of {fmt_bytes(total)} ({100 * done / max(total, 1):.0f}%)"
                f"{self._rate(m.name)}",
                file=self.stream,
                flush=True,
            )

    def _draw(self) -> None:
        if self.drawn:
            self.stream.write(f"\x1b[{len(self.names)}A")
        for n in self.names:
            done, total = self.state[n]
            frac = done / total if total else 0.0
            bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
            self.stream.write(
                f"\r{n:<{self.width}} [{bar}] {100 * frac:5.1f}%  {fmt_bytes(done)} / {fmt_bytes(total)}"
                f"{self._rate(n)}\x1b[K\n"
            )
        self.stream.flush()
        self.drawn = True
