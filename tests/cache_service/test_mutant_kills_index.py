"""The global index against a model written out directly (a set of keys per replica and group):
any interleaving of stored / removed / cleared events from three replicas, pushed through the
production `EventSink` packing, replayed batches, gaps, purges and re-adds. Written to kill
mutants `make mutants` found surviving."""

from __future__ import annotations

from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service import RequestBlockHashes
from cache_service.events import AllBlocksCleared, BlockRemoved, BlockStored, EventSink, pack_events
from cache_service.global_index import ApplyResult, GlobalIndex
from cache_service.messages import BlockRecord, RecordKind
from cache_service.simulate import make_tokens

KEYS = RequestBlockHashes(16, make_tokens(96, 2, 50)).hashes  # 6 keys
REPLICAS = ("r0", "r1", "r2")
NUM_GROUPS = 3

OP = st.one_of(
    st.tuples(st.sampled_from(["stored", "removed"]), st.integers(0, 2), st.integers(0, 2),
              st.sets(st.integers(0, 5), min_size=1, max_size=3)),
    st.tuples(st.sampled_from(["cleared", "push", "replay", "purge"]), st.integers(0, 2), st.integers(0, 2),
              st.just(frozenset())),
)


def expected_holders(model: dict[str, list[set]], bits: dict[str, int]) -> list[dict]:
    out: list[dict] = [{} for _ in range(NUM_GROUPS)]
    for r, groups in model.items():
        for g, keys in enumerate(groups):
            for k in keys:
                out[g][k] = out[g].get(k, 0) | 1 << bits[r]
    return out


@settings(max_examples=50)  # ~1 s: it runs for every mutant of the index and the events
@given(st.lists(OP, max_size=40))
def test_the_index_equals_a_set_model_under_any_event_history(ops):
    index = GlobalIndex(NUM_GROUPS)
    sinks = {r: EventSink(r) for r in REPLICAS}
    model = {r: [set() for _ in range(NUM_GROUPS)] for r in REPLICAS}  # what each replica holds
    pending = {r: [set() for _ in range(NUM_GROUPS)] for r in REPLICAS}  # ... once its events arrive
    last_batch: dict[str, tuple] = {}
    for r in REPLICAS:
        index.add_replica(r)
    for op, i, g, key_ids in ops + [("push", i, 0, frozenset()) for i in range(3)]:
        r = REPLICAS[i]
        keys = tuple(KEYS[k] for k in sorted(key_ids))
        if op == "stored":
            sinks[r].stored(g, keys)
            pending[r][g] |= set(keys)
        elif op == "removed":
            sinks[r].removed(g, keys)
            pending[r][g] -= set(keys)
        elif op == "cleared":
            sinks[r].cleared(g)
            pending[r][g] = set()
        elif op == "push":
            first, end, records = sinks[r].take_batch()
            result = index.apply_batch(r, first, end, records)
            assert result == ApplyResult(len(records) if end > first else 0, False)
            model[r] = [set(s) for s in pending[r]]
            last_batch[r] = (first, end, records)
        elif op == "replay" and r in last_batch:  # an old batch (already applied): skipped
            assert index.apply_batch(r, *last_batch[r]) == ApplyResult(0, False)
        elif op == "purge":
            assert index.purge(r) == sum(len(s) for s in model[r])
            assert index.purge(r) == 0
            state = index.add_replica(r)
            assert (state.replica_id, state.stale, state.next_seq) == (r, False, 0)
            sinks[r], last_batch[r] = EventSink(r), (0, 0, ())
            model[r] = [set() for _ in range(NUM_GROUPS)]
            pending[r] = [set() for _ in range(NUM_GROUPS)]
        bits = {r: s.bit for r, s in index.replicas.items()}
        assert sorted(bits.values()) == [0, 1, 2]
        assert index.holders == expected_holders(model, bits)
        for r in REPLICAS:
            assert index.replicas[r].num_entries == [len(s) for s in model[r]]
            for g in range(NUM_GROUPS):
                view = index.view(r)
                assert [view.is_cached(g, k) for k in KEYS] == [k in model[r][g] for k in KEYS]
        for n in range(4):
            for subset in combinations((*REPLICAS, "zz"), n):
                assert index.mask_of(subset) == sum(1 << bits[r] for r in set(subset) - {"zz"})


def test_gaps_stale_replicas_and_unordered_events_are_refused():
    index = GlobalIndex(2)
    index.add_replica("r0")
    rec = (BlockRecord(RecordKind.STORED, KEYS[0], 0b01),)
    assert index.apply_batch("r0", 0, 1, rec) == ApplyResult(1, False)
    assert index.apply_batch("r0", 0, 1, rec) == ApplyResult(0, False)  # ends at next_seq: old
    assert index.apply_batch("r0", 2, 3, rec) == ApplyResult(0, True)  # a gap
    assert index.replicas["r0"].stale and index.mask_of(["r0"]) == 0 and index.routable_mask() == 0
    assert index.apply_batch("r0", 1, 2, rec) == ApplyResult(0, True)  # stale: nothing until a resync
    assert index.apply("r0", []) == ApplyResult(0, True)
    assert index.apply("new", []) == ApplyResult(0, False) and not index.replicas["new"].stale
    assert index.mask_of(index.replicas.keys()) == index.routable_mask() == 1 << index.replicas["new"].bit
    unordered = [BlockStored(1, 0, (KEYS[1],)), BlockStored(0, 0, (KEYS[2],))]
    assert index.apply("new", unordered) == ApplyResult(0, True) and index.replicas["new"].stale
    assert index.apply("other", unordered) == ApplyResult(0, True) and index.replicas["other"].stale
    assert index.mask_of(index.replicas.keys()) == 0
    assert not index.end_resync("r0", "never-begun", 5) and index.replicas["r0"].stale
    assert not index.end_resync("ghost", "x", 5)
    index.begin_resync("fresh", "a")  # unknown: added, stale until the resync ends
    assert index.replicas["fresh"].stale and index.end_resync("fresh", "a", 4)
    assert index.apply_batch("fresh", 4, 5, rec) == ApplyResult(1, False)


def test_removal_keeps_other_replicas_bits_and_clears_only_their_groups():
    index = GlobalIndex(2)
    for r in ("a", "b"):
        index.add_replica(r)
        index.apply_batch(r, 0, 1, (BlockRecord(RecordKind.STORED, KEYS[0], 0b11),))
    index.apply_batch("a", 1, 2, (BlockRecord(RecordKind.REMOVED, KEYS[0], 0b01),))
    assert index.holders == [{KEYS[0]: 0b10}, {KEYS[0]: 0b11}]
    index.apply_batch("b", 1, 2, (BlockRecord(RecordKind.CLEARED, None, 0b10),))
    assert index.holders == [{KEYS[0]: 0b10}, {KEYS[0]: 0b01}]
    assert index.replicas["b"].num_entries == [1, 0] and index.replicas["a"].num_entries == [0, 1]
    assert index.resync_chunk("a", "none", 0, [KEYS[1]]) is False  # no resync in progress


def test_packing_merges_groups_per_block_and_clears_across_groups():
    events = [BlockStored(0, 0, (KEYS[0], KEYS[1])), BlockStored(1, 2, (KEYS[0],)), AllBlocksCleared(2, 1),
              AllBlocksCleared(3, 0), BlockStored(4, 1, (KEYS[0],)), BlockRemoved(5, 0, (KEYS[1],)),
              BlockStored(6, 0, (KEYS[0],))]
    S, R, C = RecordKind.STORED, RecordKind.REMOVED, RecordKind.CLEARED
    assert pack_events(events) == (
        BlockRecord(S, KEYS[0], 0b101), BlockRecord(S, KEYS[1], 0b001), BlockRecord(C, None, 0b011),
        BlockRecord(S, KEYS[0], 0b011), BlockRecord(R, KEYS[1], 0b001))
    assert pack_events([AllBlocksCleared(0, 2)]) == (BlockRecord(C, None, 0b100),)
    sink = EventSink("r")
    sink.cleared(2)
    sink.removed(1, ())
    sink.stored(1, ())
    assert sink.take_batch() == (0, 1, (BlockRecord(C, None, 0b100),))


def test_a_chunked_resync_of_one_replica_keeps_the_others_bits():
    index = GlobalIndex(2)
    for r in ("a", "b"):
        index.add_replica(r)
    index.apply_batch("a", 0, 1, (BlockRecord(RecordKind.STORED, KEYS[0], 0b01),))
    index.begin_resync("b", "x")
    assert index.resync_chunk("b", "x", 0, [KEYS[0], KEYS[1]])
    assert index.resync_chunk("b", "x", 0, [KEYS[1], KEYS[2]])  # KEYS[1] again: counted once
    assert index.end_resync("b", "x", 7)
    assert index.holders[0] == {KEYS[0]: 0b11, KEYS[1]: 0b10, KEYS[2]: 0b10}
    assert index.replicas["b"].num_entries == [3, 0] and index.replicas["b"].next_seq == 7
