"""A program run inside a bed host (a Ray driver: a front door, the chaos soak's driver) that
answers one JSON line on its stdout for each line it is sent on its stdin.

    driver = BedDriver(bed.popen_in(0, argv, stdin=PIPE, stdout=PIPE, stderr=log, text=True), log)
    placed = driver.read()            its first answer (the cluster is up)
    reply = driver.ask(count=True)    {"count": true} sent, the next answer read

Lines that are not JSON objects are skipped (Ray prints its own there: a node's death). A driver
that exits, or gives no answer within the timeout, raises with the tail of its stderr log.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading


class BedDriver:
    def __init__(self, proc: subprocess.Popen, log, timeout_s: float | None = None) -> None:
        """`log`: the file (opened w+) the driver's stderr goes to; `timeout_s`: the longest wait
        for one answer (None: as long as the driver lives)."""
        self.proc, self.log, self.timeout_s = proc, log, timeout_s
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True, name="bed-driver-stdout").start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self._lines.put(line)
        self._lines.put("")  # end of stdout: the driver exited

    def read(self) -> dict:
        try:
            line = self._lines.get(timeout=self.timeout_s)
        except queue.Empty:
            raise RuntimeError(f"the driver gave no answer in {self.timeout_s:.0f} s:\n{self._tail()}") from None
        if not line:
            self._lines.put("")  # every later read sees the end too
            self.proc.wait(timeout=30)
            raise RuntimeError(f"the driver exited {self.proc.returncode}:\n{self._tail()}")
        return json.loads(line)

    def send(self, line: str) -> dict:
        """`line` to the driver's stdin; its answer."""
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.read()

    def ask(self, **msg) -> dict:
        return self.send(json.dumps(msg))

    def _tail(self, chars: int = 6000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-chars:]
