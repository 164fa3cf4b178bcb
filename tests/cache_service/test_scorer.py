"""The one-pass all-replica scorer agrees with the per-replica coordinator (a differential test on
random layouts, cache contents and EAGLE modes), and it is one pass: the index is probed once
per chain position and group, whatever the number of replicas."""

import random

import pytest

from cache_service import EagleMode, HybridCoordinator, SetLookup
from cache_service.scorer import AllReplicaScorer
from tests.cache_service.helpers import make_hashes, make_layout

GROUP_CHOICES = ("full:16", "full:32", "mamba:32", "mamba:64", "sliding_window:16:40", "sliding_window:32:70",
                 "draft:16", "draft:32")


def random_layout(rng):
    groups = ["full:16"] + rng.sample(GROUP_CHOICES, rng.randint(1, 3))
    return make_layout(*groups)


def random_contents(rng, layout, hashes, num_tokens):
    """One replica: per group a random set of prefix keys (a mix of prefixes and holes)."""
    h = layout.hash_block_size
    contents = []
    for spec in layout.groups:
        ends = range(spec.block_size, len(hashes.hashes) * h + 1, spec.block_size)
        style = rng.random()
        if style < 0.3:  # a contiguous prefix
            stop = rng.randint(0, num_tokens)
            keep = {e for e in ends if e <= stop}
        elif style < 0.5:
            keep = set()
        else:
            density = rng.random()
            keep = {e for e in ends if rng.random() < density}
        contents.append({hashes.prefix_hash(e) for e in keep})
    return contents


def holders_of(replicas, num_groups):
    holders = [{} for _ in range(num_groups)]
    for bit, contents in enumerate(replicas):
        for g, keys in enumerate(contents):
            for k in keys:
                holders[g][k] = holders[g].get(k, 0) | (1 << bit)
    return holders


@pytest.mark.parametrize("rule", ["lookahead", "alignment"])
@pytest.mark.parametrize("seed", range(40))
def test_one_pass_scores_equal_the_coordinator_per_replica(seed, rule):
    rng = random.Random(seed)
    layout = random_layout(rng)
    attention = list(layout.attention_group_ids)
    draft = rng.sample(attention, rng.randint(0, len(attention))) if rng.random() < 0.5 else []
    coord = HybridCoordinator(layout, rng.choice(list(EagleMode)), draft, drop_rule=rule)
    scorer = AllReplicaScorer(coord)
    for trial in range(6):
        num_tokens = rng.randint(1, 700)
        hashes = make_hashes(layout, num_tokens, seed=rng.randrange(3))
        replicas = [random_contents(rng, layout, hashes, num_tokens) for _ in range(rng.randint(1, 9))]
        holders = holders_of(replicas, len(layout.groups))
        everyone = (1 << len(replicas)) - 1
        scores = scorer.score(hashes.hashes, num_tokens, holders, everyone)
        for bit, contents in enumerate(replicas):
            want = coord.find_longest_hit(hashes.hashes, num_tokens, SetLookup(contents), per_group=False)
            got = (scores.hit_tokens.get(bit, 0), scores.attention_tokens.get(bit, 0))
            assert got == (want.hit_tokens, want.attention_match_tokens), (layout.describe(), coord.eagle, trial, bit)


def test_the_scorer_skips_replicas_outside_the_candidates():
    layout = make_layout("full:16", "mamba:64")
    coord = HybridCoordinator(layout)
    hashes = make_hashes(layout, 300)
    full = [{hashes.prefix_hash(e) for e in range(16, 257, 16)}, {hashes.prefix_hash(256)}]
    holders = holders_of([full, full], 2)
    assert scorer_hits(coord, hashes, holders, 0b11) == {0: 256, 1: 256}
    assert scorer_hits(coord, hashes, holders, 0b10) == {1: 256}


def scorer_hits(coord, hashes, holders, candidates):
    return AllReplicaScorer(coord).score(hashes.hashes, 300, holders, candidates).hit_tokens


class CountingDict(dict):
    probes = 0

    def get(self, key, default=None):
        CountingDict.probes += 1
        return super().get(key, default)


def test_index_probes_do_not_grow_with_the_number_of_replicas():
    """A per-replica loop would probe R times as often; one pass probes each key once per group."""
    layout = make_layout("full:16", "mamba:64")
    coord = HybridCoordinator(layout, EagleMode.DROP)
    hashes = make_hashes(layout, 1000)
    probes = []
    for num_replicas in (2, 64):
        rng = random.Random(1)
        replicas = [random_contents(rng, layout, hashes, 1000) for _ in range(num_replicas)]
        replicas[0] = [set(hashes.hashes), set(hashes.hashes)]  # one replica holds everything
        holders = [CountingDict(d) for d in holders_of(replicas, 2)]
        CountingDict.probes = 0
        AllReplicaScorer(coord).score(hashes.hashes, 1000, holders, (1 << num_replicas) - 1)
        probes.append(CountingDict.probes)
    assert probes[0] == probes[1] <= 2 * len(hashes.hashes)


def lookahead_brute_force(coord, num_tokens, ends_per_group):
    """The spec of the lookahead drop, written out: a dropping group serves L iff it serves L and
    the block of its own size starting at L is cached (ending at most at num_prompt_tokens)."""
    from tests.cache_service.helpers import serves_raw

    step, cap = coord.alignment, num_tokens - 1

    def serves(g, spec, length):
        if length == 0:
            return True
        ok = serves_raw(spec, length, ends_per_group[g])
        if g in coord.dropping_groups:
            end = length + spec.block_size
            ok = ok and end <= num_tokens and end in ends_per_group[g]
        return ok

    return max(L for L in range(0, max(cap, 0) + 1, step)
               if all(serves(g, spec, L) for g, spec in enumerate(coord.layout.groups)))


@pytest.mark.parametrize("seed", range(25))
def test_lookahead_rule_matches_its_spec(seed):
    """The `lookahead` drop rule against a brute force of the rule's text (the coordinator gets the
    same rule from the cache core; the differential test above then covers both)."""
    rng = random.Random(1000 + seed)
    layout = random_layout(rng)
    coord = HybridCoordinator(layout, EagleMode.DROP)
    scorer = AllReplicaScorer(coord)
    scorer.drop_rule = "lookahead"
    h = layout.hash_block_size
    for _ in range(6):
        num_tokens = rng.randint(1, 700)
        hashes = make_hashes(layout, num_tokens, seed=rng.randrange(3))
        replicas = [random_contents(rng, layout, hashes, num_tokens) for _ in range(rng.randint(1, 6))]
        scores = scorer.score(hashes.hashes, num_tokens, holders_of(replicas, len(layout.groups)),
                              (1 << len(replicas)) - 1)
        for bit, contents in enumerate(replicas):
            ends = [{e for e in range(h, len(hashes.hashes) * h + 1, h) if hashes.prefix_hash(e) in keys}
                    for keys in contents]
            assert scores.hit_tokens.get(bit, 0) == lookahead_brute_force(coord, num_tokens, ends)
