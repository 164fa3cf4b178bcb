"""The cache service's op log: every call that changed its routing state, in the order applied.

    service (single writer)  --append(op)-->  [ ... ops seq s .. s+n-1 ... ]  (bounded: the oldest go)
    front door's follower    --since(cursor, wait_s)-->  the ops from `cursor` on (waits for one)

A read replica (`index_mirror.IndexMirror`) that replays the same ops from the same starting
state holds the same index and loads: the service is a deterministic state machine over them.
The log keeps at most `max_ops` ops and `max_keys` block keys (a resync chunk counts its keys);
a follower that asks for ops already dropped is told it is `behind` and loads a snapshot.
`since` may wait on another thread (a Ray concurrency group): the log has its own lock.
"""

from __future__ import annotations

import threading

from cache_service.messages import EventBatchMsg, IndexOpsMsg, ResyncChunkMsg, WholeResyncOp


def op_keys(op) -> int:
    """What an op weighs in the log's key budget."""
    if isinstance(op, EventBatchMsg):
        return len(op.records)
    if isinstance(op, ResyncChunkMsg):
        return len(op.keys)
    if isinstance(op, WholeResyncOp):
        return sum(len(keys) for keys in op.contents)
    return 1


class IndexLog:
    def __init__(self, epoch: str, max_ops: int = 100_000, max_keys: int = 4_000_000) -> None:
        self.epoch = epoch
        self.max_ops = max_ops
        self.max_keys = max_keys
        self.first_seq = 0  # seq of the oldest op held: self._ops[self._head]
        self._ops: list = []  # a list with a moving head (indexed reads; compacted as it grows)
        self._head = 0
        self._num_keys = 0
        self._cv = threading.Condition()

    @property
    def end_seq(self) -> int:
        """The seq the next op gets."""
        return self.first_seq + len(self._ops) - self._head

    def append(self, op) -> None:
        with self._cv:
            self._ops.append(op)
            self._num_keys += op_keys(op)
            while len(self._ops) - self._head > 1 and (len(self._ops) - self._head > self.max_ops
                                                       or self._num_keys > self.max_keys):
                self._num_keys -= op_keys(self._ops[self._head])
                self._ops[self._head] = None
                self._head += 1
                self.first_seq += 1
            if self._head > 4096 and self._head * 2 > len(self._ops):
                del self._ops[:self._head]
                self._head = 0
            self._cv.notify_all()

    def since(self, cursor: int, wait_s: float = 0.0, max_keys: int = 262_144) -> IndexOpsMsg:
        """Ops from `cursor` (up to about `max_keys` keys' worth); waits up to `wait_s` for one
        when there is none yet. A cursor past the end (another epoch's) counts as behind."""
        with self._cv:
            if cursor == self.end_seq and wait_s > 0:
                self._cv.wait_for(lambda: self.end_seq > cursor, timeout=wait_s)
            if cursor < self.first_seq or cursor > self.end_seq:
                return IndexOpsMsg(self.epoch, cursor, (), behind=True)
            out, keys = [], 0
            for i in range(self._head + cursor - self.first_seq, len(self._ops)):
                op = self._ops[i]
                out.append(op)
                keys += op_keys(op)
                if keys >= max_keys:
                    break
            return IndexOpsMsg(self.epoch, cursor, tuple(out))
