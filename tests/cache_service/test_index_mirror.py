"""A front door's read replica of the index (`IndexMirror`) holds the service's routing state and
decides as the service does: a differential test on random layouts, EAGLE modes, both drop rules
and random op streams (membership, pushed batches with gaps, chunked and whole resyncs, purges,
decisions booked by the service and by two mirrors), with mirrors joining mid-stream from a
snapshot and following the log in random slices. Plus the log's own bounds."""

import copy
import random

import pytest

from cache_service import EagleMode
from cache_service.index_log import IndexLog
from cache_service.index_mirror import IndexMirror
from cache_service.messages import (
    BlockRecord,
    EventBatchMsg,
    LoadReportMsg,
    RecordKind,
    ReplicaMembershipOp,
    ResyncChunkMsg,
    RouteRequestMsg,
)
from cache_service.router import NoReplicaError
from cache_service.service import CacheService
from tests.cache_service.helpers import make_hashes, make_layout
from tests.cache_service.test_scorer import GROUP_CHOICES


class Stream:
    """Random traffic into one service: replicas, their caches (prefix keys of a few prompts)."""

    def __init__(self, rng: random.Random, service: CacheService, layout) -> None:
        self.rng, self.service, self.layout = rng, service, layout
        self.prompts = [make_hashes(layout, rng.randint(64, 600), seed=s) for s in range(4)]
        self.keys = [k for p in self.prompts for k in p.hashes]
        self.seq: dict[str, int] = {}
        self.accepted: dict[str, int] = {}
        self.next_id = 0

    def step(self) -> None:
        rng, svc = self.rng, self.service
        live = sorted(svc.index.replicas)
        roll = rng.random()
        if roll < 0.08 or not live:
            rid = f"r{self.next_id}"
            self.next_id += 1
            svc.add_replica(rid)
            self.seq[rid] = 0
        elif roll < 0.12:
            svc.remove_replica(rng.choice(live))
        elif roll < 0.65:
            rid = rng.choice(live)
            n = rng.randint(0, 12)  # 0: a heartbeat carrying only the load
            first = self.seq.get(rid, 0) + (rng.random() < 0.05)  # sometimes a gap: stale
            records = tuple(BlockRecord(RecordKind.STORED if rng.random() < 0.75 else RecordKind.REMOVED,
                                        rng.choice(self.keys), rng.randint(1, 2 ** len(self.layout.groups) - 1))
                            for _ in range(n))
            if rng.random() < 0.03:
                records += (BlockRecord(RecordKind.CLEARED, None, 1),)
            self.accepted[rid] = self.accepted.get(rid, 0) + rng.randint(0, 2)
            load = LoadReportMsg(rng.randrange(0, 3000), rng.randint(0, 4), 100, self.accepted[rid])
            reply = svc.ingest(EventBatchMsg(rid, first, first + len(records), records, load))
            self.seq[rid] = reply.next_seq if reply.accepted else first + len(records)
        elif roll < 0.75:
            rid = rng.choice(live)
            if rng.random() < 0.1:  # a replica this service never heard of (it was restarted) resyncs
                rid = f"r{self.next_id}"
                self.next_id += 1
            resync = f"rs{rng.randrange(10**6)}"
            groups = list(range(len(self.layout.groups)))
            for i, g in enumerate(groups):
                keys = tuple(rng.sample(self.keys, rng.randint(0, 20)))
                svc.resync_chunk(ResyncChunkMsg(rid, resync, g, keys, self.seq.get(rid, 0), i == 0,
                                                i == len(groups) - 1 and rng.random() < 0.9))
        elif roll < 0.8:
            rid = rng.choice(live) if rng.random() < 0.9 else f"r{self.next_id}"  # or one never heard of
            self.next_id += rid == f"r{self.next_id}"
            svc.resync(rid, [rng.sample(self.keys, rng.randint(0, 20)) for _ in self.layout.groups],
                       self.seq.get(rid, 0))
        else:
            self.service.route(self.request())

    def request(self, dry_run: bool = False) -> RouteRequestMsg:
        prompt = self.rng.choice(self.prompts)
        n = self.rng.randint(1, len(prompt.hashes) * self.layout.hash_block_size)
        return RouteRequestMsg(tuple(prompt.hashes), n, None, self.rng.randint(1, 64), dry_run=dry_run)


def catch_up(rng, mirror: IndexMirror, service: CacheService) -> None:
    while mirror.cursor < service.log.end_seq:
        msg = service.log.since(mirror.cursor, max_keys=rng.randint(1, 50))
        assert mirror.apply(msg)
    service.note_routed(mirror.take_booked())


def same_state(mirror: IndexMirror, service: CacheService) -> None:
    m = mirror.state
    assert m.index.holders == service.index.holders
    assert {r: (s.bit, s.stale, s.next_seq, s.resync_id, s.num_entries) for r, s in m.index.replicas.items()} == \
        {r: (s.bit, s.stale, s.next_seq, s.resync_id, s.num_entries) for r, s in service.index.replicas.items()}
    assert m._purged == service._purged
    assert service.index.replicas.keys() <= service.loads.current.keys()  # every indexed replica has a load
    assert {r: load.report for r, load in m.loads._loads.items()} == \
        {r: load.report for r, load in service.loads._loads.items()}


@pytest.mark.parametrize("rule", ["lookahead", "alignment"])
@pytest.mark.parametrize("seed", range(12))
def test_a_mirror_following_the_log_routes_as_the_service(seed, rule):
    rng = random.Random(seed)
    groups = ["full:16"] + rng.sample(GROUP_CHOICES, rng.randint(1, 3))
    layout = make_layout(*groups)
    eagle = list(EagleMode)[seed % len(EagleMode)].value
    service = CacheService(groups, eagle, "fp", seed=1, drop_rule=rule)
    stream = Stream(rng, service, layout)
    mirrors: list[IndexMirror] = []
    compared = 0
    for step in range(400):
        stream.step()
        if step in (30, 150):  # front doors joining mid-stream
            mirror = IndexMirror(f"door-{step}")
            mirror.load(service.snapshot())
            mirrors.append(mirror)
        if mirrors and rng.random() < 0.15:  # a mirror's own decision, booked there and told to the service
            try:
                rng.choice(mirrors).route(stream.request())
            except NoReplicaError:
                pass
        if mirrors and rng.random() < 0.2:
            for mirror in mirrors:
                catch_up(rng, mirror, service)
            for mirror in mirrors:  # bookings told by one mirror reach the other
                catch_up(rng, mirror, service)
                same_state(mirror, service)
                msg = stream.request(dry_run=True)
                mirror.state.router._rng.seed(step)
                service.router._rng.seed(step)
                # a mirror books its own decisions at once, so a report may retire its pending
                # entries in another order than the service's: loads are an estimate, compared
                # here on equal terms (the index and the decision rule are what must agree)
                own_loads, mirror.state.loads = mirror.state.loads, copy.deepcopy(service.loads)
                try:
                    want = service.route(msg)
                except NoReplicaError:
                    with pytest.raises(NoReplicaError):
                        mirror.route(msg)
                    mirror.state.loads = own_loads
                    continue
                assert mirror.route(msg) == want
                mirror.state.loads = own_loads
                compared += 1
    assert compared >= 10


def test_a_mirror_skips_ops_of_another_service_instance_and_ops_it_missed():
    service = CacheService(["full:16", "mamba:64"], "lossless", "fp")
    service.add_replica("a")
    mirror = IndexMirror("door")
    mirror.load(service.snapshot())
    service.add_replica("b")
    other = CacheService(["full:16", "mamba:64"], "lossless", "fp")  # a restarted service: a new epoch
    other.add_replica("x")
    assert not mirror.apply(other.log.since(mirror.cursor))
    assert not mirror.apply(service.log.since(mirror.cursor + 1))  # not the continuation
    assert mirror.apply(service.log.since(mirror.cursor))
    assert set(mirror.state.index.replicas) == {"a", "b"}
    mirror.invalidate()
    with pytest.raises(NoReplicaError):
        mirror.route(RouteRequestMsg((), 10))


def test_a_mirrors_own_decisions_are_booked_once_here_and_at_the_service():
    service = CacheService(["full:16", "mamba:64"], "lossless", "fp")
    service.add_replica("a")
    mirrors = [IndexMirror("door-1"), IndexMirror("door-2")]
    for m in mirrors:
        m.load(service.snapshot())
    for _ in range(3):
        mirrors[0].route(RouteRequestMsg((), 100, None, 20))
    assert mirrors[0].state.loads.current == {"a": 360}
    rng = random.Random(0)
    for m in mirrors:
        catch_up(rng, m, service)
    assert service.loads.current == {"a": 360}
    for m in mirrors:
        catch_up(rng, m, service)
        assert m.state.loads.current == {"a": 360}, m.mirror_id


def test_the_log_drops_its_oldest_ops_beyond_its_bounds_and_says_a_follower_is_behind():
    log = IndexLog("e", max_ops=3, max_keys=100)
    for i in range(5):
        log.append(ReplicaMembershipOp(f"r{i}", True))
    assert (log.first_seq, log.end_seq) == (2, 5)
    assert log.since(1).behind and log.since(6).behind
    assert [op.replica_id for op in log.since(2).ops] == ["r2", "r3", "r4"]
    log.append(ResyncChunkMsg("r", "x", 0, tuple(bytes([i]) for i in range(100)), 0))  # 100 keys: the rest go
    assert log.first_seq == 5 and [type(op).__name__ for op in log.since(5).ops] == ["ResyncChunkMsg"]
    assert log.since(log.end_seq, wait_s=0.01).ops == ()
    for _ in range(10_000):  # the list's dropped head is compacted away
        log.append(ReplicaMembershipOp("r", True))
    assert len(log._ops) <= 2 * 4096 + 3


@pytest.mark.parametrize("seed", range(6))
def test_the_log_against_a_plain_list_of_every_op(seed):
    """The bounded log holds exactly the newest ops a plain list would, within both budgets, and
    answers any cursor: the ops from there (at most about `max_keys` keys' worth, at least one),
    or `behind` with its own epoch."""
    rng = random.Random(seed)
    log = IndexLog("epoch-x", max_ops=rng.randint(3, 40), max_keys=rng.randint(20, 200))
    every: list = []
    for step in range(5000 if seed == 0 else 600):
        n = rng.choice([0, 1, 1, 2, 5, 30])
        op = (ResyncChunkMsg("r", "x", 0, tuple(bytes([i % 256]) for i in range(n)), step) if rng.random() < 0.7
              else ReplicaMembershipOp(f"r{step}", True))
        log.append(op)
        every.append(op)
        assert log.end_seq == len(every)
        held = every[log.first_seq:]
        weights = [len(o.keys) if isinstance(o, ResyncChunkMsg) else 1 for o in held]
        assert len(held) <= log.max_ops or len(held) == 1
        assert sum(weights) <= log.max_keys or len(held) == 1
        if log.first_seq > 0:  # the oldest op went only because a budget needed it to
            dropped = every[log.first_seq - 1]
            w = len(dropped.keys) if isinstance(dropped, ResyncChunkMsg) else 1
            assert len(held) + 1 > log.max_ops or sum(weights) + w > log.max_keys
        cursor = rng.randint(max(0, log.first_seq - 3), log.end_seq + 2)
        budget = rng.randint(1, 60)
        msg = log.since(cursor, max_keys=budget)
        assert msg.epoch == "epoch-x" and msg.first_seq == cursor
        if cursor < log.first_seq or cursor > log.end_seq:
            assert msg.behind and msg.ops == ()
            continue
        assert not msg.behind and list(msg.ops) == every[cursor: cursor + len(msg.ops)]
        got = [len(o.keys) if isinstance(o, ResyncChunkMsg) else 1 for o in msg.ops]
        if cursor < log.end_seq:
            assert msg.ops and (cursor + len(msg.ops) == log.end_seq or sum(got) >= budget)
            assert sum(got[:-1]) < budget  # it stops at the first op that reaches the budget
        else:
            assert msg.ops == ()


@pytest.mark.timeout(10)
def test_a_follower_waits_for_the_next_op_only_at_the_end_of_the_log():
    import threading

    log = IndexLog("e")
    log.append(ReplicaMembershipOp("a", True))
    assert len(log.since(0, wait_s=30).ops) == 1  # ops are there: no wait (a 30-s wait would time the test out)
    threading.Timer(0.05, log.append, args=(ReplicaMembershipOp("b", True),)).start()
    assert [op.replica_id for op in log.since(1, wait_s=30).ops] == ["b"]  # woken by the append
