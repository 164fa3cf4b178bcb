"""The prompts a front door served most recently, by use count: what a new replica is warmed with.

The front door remembers each finished request's prompt up to its last aligned boundary (+ 1
token: the hit must leave one to compute) and hands the list to the controller
(`HotPrefixMsg`s), which merges every front door's (`control.warmup`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from cluster.messages import HotPrefixMsg


class HotPrefixes:
    def __init__(self, alignment: int, capacity: int) -> None:
        self.alignment = alignment
        self.capacity = capacity
        self._lock = threading.Lock()
        self._uses: OrderedDict[tuple, int] = OrderedDict()  # (prompt prefix, salt) -> times served

    def remember(self, prompt: list[int] | tuple[int, ...], salt: str | None) -> None:
        length = (len(prompt) - 1) // self.alignment * self.alignment
        if length <= 0:
            return
        key = (tuple(prompt[: length + 1]), salt)
        with self._lock:
            self._uses[key] = self._uses.pop(key, 0) + 1
            while len(self._uses) > self.capacity:
                self._uses.popitem(last=False)

    def items(self) -> list[HotPrefixMsg]:
        with self._lock:
            return [HotPrefixMsg(prompt, salt, n) for (prompt, salt), n in self._uses.items()]
