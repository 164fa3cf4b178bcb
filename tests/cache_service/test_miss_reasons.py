"""Miss reasons (`cache_service.miss_reasons`): each short lookup gets the reason that cost it the
hit, at the exact position; a full hit gets none."""

import pytest

from cache_service import EagleMode, HybridCoordinator, LocalPrefixCache, RequestBlockHashes
from cache_service.miss_reasons import (
    LookupReport,
    MissReason,
    RecentlyEvicted,
    SaltedPrefixes,
    classify_miss,
    describe_reason,
    salt_miss,
)
from cache_service.retention import CheckpointPlanner, make_retention
from cache_service.simulate import make_tokens, run_request, simulate
from tests.cache_service.helpers import make_layout, make_scenario


def make_cache(groups, sizes, eagle=EagleMode.OFF, retention="latest", rule="lookahead"):
    coord = HybridCoordinator(make_layout(*groups), eagle, drop_rule=rule)
    cache = LocalPrefixCache(coord, sizes)
    evicted = RecentlyEvicted(coord.layout, capacity=64)
    cache.events.taps.append(evicted)
    planner = CheckpointPlanner(coord, make_retention(retention, coord.alignment))

    def send(tokens):
        return run_request(cache, planner, tokens, None, explain=False, evicted=evicted).report

    return cache, evicted, send


def reason_of(report: LookupReport):
    return report.reason, report.reason_position


def test_an_identical_resend_that_hits_has_no_reason():
    _, _, send = make_cache(["full:16", "mamba:64"], [400, 40])
    prompt = make_tokens(600, 1, 1000)
    assert reason_of(send(prompt)) == (None, 0)  # cold: nothing shared
    report = send(prompt)
    assert report.hit_tokens == 576 and reason_of(report) == (None, 0)


def test_a_prompt_shorter_than_one_grid_unit_is_below_grid():
    _, _, send = make_cache(["full:16", "mamba:64"], [40, 8])
    prompt = make_tokens(40, 1, 1000)
    send(prompt)
    report = send(prompt)
    assert (report.hit_tokens, report.shared_prefix_tokens) == (0, 32)
    assert reason_of(report) == ("below_grid", 32)  # two 16-token blocks cached, the grid is 64


@pytest.mark.parametrize("groups, eagle, hit", [
    (["full:16", "mamba:64"], EagleMode.OFF, 512),
    (["full:16", "mamba:64", "draft:16"], EagleMode.DROP, 448),  # the junction's lookahead block is not shared
])
def test_a_diverging_sibling_misses_for_want_of_a_state_then_the_next_one_hits(groups, eagle, hit):
    _, _, send = make_cache(groups, [400] * len(groups), eagle)
    system = make_tokens(520, 7, 1000)
    send(system + make_tokens(100, 1, 1000))
    second = send(system + make_tokens(100, 2, 1000))
    assert second.hit_tokens == 0 and reason_of(second) == ("state_not_retained", 512)  # not the drop's doing
    third = send(system + make_tokens(100, 3, 1000))
    assert third.hit_tokens == hit and reason_of(third) == ((None, 0) if hit == 512 else ("eagle_drop", 512))


def test_an_evicted_state_is_told_from_one_never_retained():
    # 2 state pages (+ the null page): a working page and one retained state; the second prompt's
    # snapshot evicts the first prompt's state at 576
    cache, evicted, send = make_cache(["full:16", "mamba:64"], [400, 3])
    first, second = make_tokens(600, 1, 1000), make_tokens(600, 2, 1000)
    send(first)
    first_state = RequestBlockHashes(16, first).prefix_hash(576)
    assert first_state in cache.pools[1].cached
    send(second)
    assert first_state not in cache.pools[1].cached and first_state in evicted
    # without the eviction record the same lookup cannot tell: never retained
    coord = cache.coordinator
    probes = coord.probes(RequestBlockHashes(16, first).hashes, 600, cache.lookup_view)
    assert classify_miss(coord, probes, coord.reconcile(probes), ()) == (MissReason.STATE_NOT_RETAINED, 576)
    report = send(first)
    assert report.hit_tokens == 0 and reason_of(report) == ("state_evicted", 576)


def test_kv_evicted_below_a_state_still_cached():
    cache, _, send = make_cache(["full:16", "mamba:64"], [400, 40])
    prompt = make_tokens(600, 1, 1000)
    send(prompt)
    hashes = RequestBlockHashes(16, prompt)
    for end in range(592, 320, -16):  # the prompt's KV blocks from token 320 on, last first
        assert cache.pools[0].evict(hashes.prefix_hash(end))
    report = send(prompt)
    assert report.per_group_hits == (320, 576) and report.hit_tokens == 0
    assert reason_of(report) == ("kv_evicted", 320)


def test_kv_evicted_when_a_window_tail_below_the_cached_prefix_is_gone():
    # A = 32; the window before 96 needs blocks [32, 64) and [64, 96) of the sliding-window group
    cache, _, send = make_cache(["full:16", "sliding_window:32:64"], [40, 40])
    prompt = make_tokens(100, 1, 1000)
    send(prompt)
    assert send(prompt).hit_tokens == 96
    assert cache.pools[1].evict(RequestBlockHashes(16, prompt).prefix_hash(64))
    report = send(prompt)
    assert (report.shared_prefix_tokens, report.attention_match_tokens, report.hit_tokens) == (96, 0, 0)
    assert reason_of(report) == ("kv_evicted", 0)


def test_kv_evicted_when_the_window_tail_where_the_full_match_ends_is_gone():
    # the sliding-window group keeps only the prompt's last tails ([128, 160), [160, 192)): once the full
    # blocks past 128 go, the window before 128 is missing although each group alone answers above 0
    cache, _, send = make_cache(["full:16", "sliding_window:32:64"], [40, 40])
    prompt = make_tokens(200, 1, 1000)
    send(prompt)
    hashes = RequestBlockHashes(16, prompt)
    for end in range(192, 128, -16):
        assert cache.pools[0].evict(hashes.prefix_hash(end))
    report = send(prompt)
    assert (report.per_group_hits, report.attention_match_tokens, report.hit_tokens) == ((128, 192), 128, 0)
    assert reason_of(report) == ("kv_evicted", 0)


@pytest.mark.parametrize("rule, prompt_len, hit, expected", [
    ("lookahead", 70, 0, 64),  # the lookahead block [64, 80) runs past the prompt's 64 hashed tokens
    ("alignment", 150, 64, 128),  # the alignment rule gives up the unit below 128 (retention kept 64)
])
def test_the_eagle_drop_is_named_with_the_hit_it_cost(rule, prompt_len, hit, expected):
    _, _, send = make_cache(["full:16", "mamba:64", "draft:16"], [400, 40, 400], EagleMode.DROP, rule=rule)
    prompt = make_tokens(prompt_len, 1, 1000)
    send(prompt)
    report = send(prompt)
    assert report.hit_tokens == hit
    assert reason_of(report) == ("eagle_drop", expected)


def test_the_seed_bug_is_an_eagle_drop_in_explain():
    result = simulate(make_scenario(["full:64", "mamba:2304", "mamba:2304", "mamba:2304"], 8901,
                                    eagle=EagleMode.DROP, drop_rule="alignment", eagle_aware_retention=False))
    assert result.resend.hit.hit_tokens == 0
    assert reason_of(result.resend.report) == ("eagle_drop", 6912)
    # the seed fix still gives up one unit to the alignment rule; the lookahead rule does not
    fixed = simulate(make_scenario(["full:64", "mamba:2304", "mamba:2304", "mamba:2304"], 8901,
                                   eagle=EagleMode.DROP, drop_rule="alignment"))
    assert fixed.resend.hit.hit_tokens == 4608 and reason_of(fixed.resend.report) == ("eagle_drop", 6912)
    lookahead = simulate(make_scenario(["full:64", "mamba:2304", "mamba:2304", "mamba:2304"], 8901,
                                       eagle=EagleMode.DROP))
    assert lookahead.resend.hit.hit_tokens == 6912 and lookahead.resend.report.reason is None


def test_explain_names_a_state_its_own_cold_request_evicted():
    # dense retention into 3 state pages: the cold request's later snapshots evict the one at 192
    result = simulate(make_scenario(["full:16", "mamba:64"], 600, resend_len=200, retention="dense",
                                    num_blocks_per_group=(60, 4)))
    assert result.resend.report == LookupReport(200, 0, (192, 0), 192, 192, (192, 0), "state_evicted", 192)


def test_recently_evicted_keeps_the_last_states_only():
    record = RecentlyEvicted(make_layout("full:16", "mamba:64"), capacity=2)
    record(0, (b"kv",))  # an attention block: not a state
    record(1, (b"a", b"b"))
    record(1, (b"c",))
    assert b"kv" not in record and b"a" not in record and b"b" in record and b"c" in record
    assert len(record) == 2


def test_salted_prefixes_name_another_tenant_with_the_same_first_unit():
    salts = SaltedPrefixes(alignment=64, capacity=2)
    prompt = make_tokens(100, 1, 1000)
    assert not salts.observe(prompt, "tenant-a")
    assert salts.observe(prompt, "tenant-b")
    assert not salts.observe(prompt, "tenant-b")  # the same tenant again: its own cache answers
    assert not salts.observe(prompt[:64], "tenant-c")  # at most one unit: can never hit anyway
    assert salts.observe(prompt[:64] + make_tokens(10, 9, 1000), None)  # the same 64 tokens, another salt
    salts.observe(make_tokens(100, 2, 1000), None)  # capacity 2: both prefixes kept
    assert salts.observe(prompt, "tenant-d")
    salts.observe(make_tokens(100, 3, 1000), None)  # a third: the oldest (prompt's) is forgotten
    salts.observe(make_tokens(100, 4, 1000), None)
    assert not salts.observe(prompt, "tenant-e")


def test_salt_relabels_only_a_lookup_that_found_nothing():
    cold = LookupReport(100, 0, (0, 0), 0, 0, (64, 0))
    assert salt_miss(cold, 64) == LookupReport(100, 0, (0, 0), 0, 0, (64, 0), "salt", 64)
    shared = LookupReport(100, 0, (64, 0), 64, 64, (64, 0), "state_not_retained", 64)
    assert salt_miss(shared, 64) is shared
    hit = LookupReport(100, 64, (64, 64), 64, 64, (64,))
    assert salt_miss(hit, 64) is hit


def test_every_reason_reads_as_a_sentence():
    for reason in MissReason:
        text = describe_reason(reason.value, 576, 64)
        assert "{" not in text and ("576" in text or "64" in text), reason


def test_a_lookup_with_prefix_caching_off_reports_nothing_shared():
    from cache_service.coordinator import HitResult

    report = LookupReport.of(300, HitResult(0, (0, 0), 0, (0,), 288), [], None)
    assert report == LookupReport(300, 0, (0, 0), 0, 0, (0,))
    coord = HybridCoordinator(make_layout("full:16", "mamba:64"))
    assert classify_miss(coord, [], HitResult(0, (0, 0), 0, (0,), 288)) is None
