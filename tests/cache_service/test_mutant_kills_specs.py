"""Group specs as typed, the scorer against the coordinator on small and odd layouts (block size
1, windows that are not multiples of the block), and the scorer's reading of a coordinator's drop
rule. Written to kill mutants `make mutants` found surviving."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service import EagleMode, EventSink, HybridCoordinator, RequestBlockHashes
from cache_service.global_index import GlobalIndex
from cache_service.hit_finders import DropRule
from cache_service.messages import BlockRecord, RecordKind
from cache_service.scorer import AllReplicaScorer
from cache_service.simulate import make_tokens
from cache_service.specs import SpecError, parse_group_spec
from tests.cache_service.helpers import make_layout


def test_group_kind_aliases_and_errors():
    assert parse_group_spec("SWA:16:128") == parse_group_spec("sliding-window:16:128") == parse_group_spec(
        "sliding_window:16:128")
    assert parse_group_spec("attention:32") == parse_group_spec("full:32")
    assert parse_group_spec("ssm:64") == parse_group_spec("mamba:64")
    with pytest.raises(SpecError, match=r"^unknown group kind 'gru' in 'gru:16'; expected one of \["):
        parse_group_spec("gru:16")
    with pytest.raises(SpecError, match=r"^bad group 'swa:16': expected sliding_window:BLOCK:WINDOW$"):
        parse_group_spec("swa:16")
    with pytest.raises(SpecError, match=r"^bad group 'mamba:16:4': expected mamba:BLOCK$"):
        parse_group_spec("mamba:16:4")


def test_an_event_sink_is_named_local_by_default():
    assert EventSink().replica_id == "local" and EventSink().enabled


LAYOUTS = [("full:1", "mamba:1"), ("sliding_window:1:4", "mamba:2"), ("sliding_window:16:18", "mamba:32"),
           ("full:16", "sliding_window:16:40", "mamba:64"), ("full:32", "mamba:32", "draft:16")]
MODES = [(EagleMode.OFF, DropRule.LOOKAHEAD), (EagleMode.DROP, DropRule.LOOKAHEAD),
         (EagleMode.DROP, DropRule.ALIGNMENT)]


@settings(max_examples=60)
@given(layout=st.sampled_from(LAYOUTS), mode=st.sampled_from(MODES), prompt_len=st.integers(1, 200),
       data=st.data())
def test_the_scorer_equals_the_coordinator_on_small_and_odd_layouts(layout, mode, prompt_len, data):
    coord = HybridCoordinator(make_layout(*layout), mode[0], drop_rule=mode[1])
    size = coord.layout.hash_block_size
    hashes = RequestBlockHashes(size, make_tokens(prompt_len, 3, 50)).hashes
    index = GlobalIndex(len(layout))
    for r in ("a", "b"):
        index.add_replica(r)
        records = []
        for i, key in enumerate(hashes):
            mask = data.draw(st.integers(0, 2 ** len(layout) - 1), label=f"{r} block {i}")
            if mask:
                records.append(BlockRecord(RecordKind.STORED, key, mask))
        index.apply_batch(r, 0, len(records), tuple(records))
    scores = AllReplicaScorer(coord).score(hashes, prompt_len, index.holders, index.mask_of(["a", "b"]))
    for r in ("a", "b"):
        expected = coord.find_longest_hit(hashes, prompt_len, index.view(r)).hit_tokens
        assert scores.hit_tokens.get(index.replicas[r].bit, 0) == expected


def test_the_scorer_reads_a_drop_rule_given_as_text_or_missing():
    """A coordinator-like object may carry the rule as a plain string, or none (older engines:
    the alignment rule)."""
    layout = make_layout("full:32", "mamba:32", "draft:16")
    hashes = RequestBlockHashes(16, make_tokens(127, 1, 50)).hashes
    index = GlobalIndex(3)
    index.add_replica("a")
    index.apply_batch("a", 0, len(hashes), tuple(BlockRecord(RecordKind.STORED, k, 0b111) for k in hashes))
    real = {rule: HybridCoordinator(layout, EagleMode.DROP, drop_rule=rule) for rule in DropRule}

    def score(coordinator) -> int:
        return AllReplicaScorer(coordinator).score(hashes, 127, index.holders, 1).hit_tokens.get(0, 0)

    fields = {k: getattr(real[DropRule.LOOKAHEAD], k) for k in ("layout", "alignment", "dropping_groups")}
    assert score(SimpleNamespace(**fields, drop_rule="lookahead")) == score(real[DropRule.LOOKAHEAD]) == 96
    assert score(SimpleNamespace(**fields)) == score(real[DropRule.ALIGNMENT]) == 64


def test_a_sliding_window_needs_a_window_above_one():
    from cache_service.specs import SlidingWindowSpec

    for window in (1, 0, "8"):
        with pytest.raises(SpecError, match=rf"^sliding_window: window must be an integer > 1, got {window!r}$"):
            SlidingWindowSpec(block_size=16, window=window)
    assert SlidingWindowSpec(block_size=16, window=2).window == 2


@settings(max_examples=80)
@given(layout=st.sampled_from([("full:1", "mamba:1"), ("sliding_window:1:3", "mamba:1")]),
       mode=st.sampled_from(MODES), prompt_len=st.integers(1, 6), data=st.data())
def test_the_scorer_equals_the_coordinator_on_tiny_prompts_at_alignment_one(layout, mode, prompt_len, data):
    test_the_scorer_equals_the_coordinator_on_small_and_odd_layouts.hypothesis.inner_test(
        layout=layout, mode=mode, prompt_len=prompt_len, data=data)
