"""A one-line stderr progress bar (no dependency): redrawn in place on a terminal, every 10% otherwise."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total: int, enabled: bool = True, stream=None) -> None:
        self.label, self.total, self.enabled = label, total, enabled
        self.stream = stream or sys.stderr
        self.num_done = self.num_errors = 0
        self._t0 = time.perf_counter()
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_decile = -1

    def update(self, ok: bool) -> None:
        self.num_done += 1
        self.num_errors += not ok
        if not self.enabled:
            return
        decile = 10 * self.num_done // max(self.total, 1)
        if self._tty or decile != self._last_decile:
            self._last_decile = decile
            self._draw()

    def line(self) -> str:
        width = 24
        filled = width * self.num_done // max(self.total, 1)
        rate = self.num_done / max(time.perf_counter() - self._t0, 1e-9)
        return (f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.num_done}/{self.total}"
                f" {rate:.1f} req/s, {self.num_errors} errors")

    def _draw(self) -> None:
        end = "" if self._tty and self.num_done < self.total else "\n"
        self.stream.write(("\r" if self._tty else "") + self.line() + end)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._tty and self.num_done < self.total:
            self.stream.write("\n")
            self.stream.flush()
