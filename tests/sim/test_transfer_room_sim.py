"""The simulated replicas report their empty attention blocks as live ones do, and the router's
transfers honour them: on the shipped trace at R = 16 with 9.09 GiB per replica (its 25% share),
every transfer planned under the default (`transfer_may_evict` False) lands where the pages it
brings fit into empty blocks, while with `transfer_may_evict` some land on full replicas."""

from __future__ import annotations

import json

from cache_service.router import RouterConfig
from cache_service.trace_sim.cli import DEFAULT_TRACE
from cache_service.trace_sim.config import load_cost_model, load_layout
from cache_service.trace_sim.engine import ClusterSim, SimSettings
from cache_service.trace_sim.trace import load_trace

BUDGET = int(9.09 * 2**30)


def planned_transfers(may_evict: bool) -> list[tuple[int, int | None, int]]:
    """(tokens moved, the destination's room in tokens, its attention match) of every transfer."""
    layout = load_layout("nemotron-nano-9b-v2")
    sim = ClusterSim(SimSettings(layout, load_cost_model("gpu"), 16, "hybrid", BUDGET,
                                 router=RouterConfig(transfer_may_evict=may_evict)))
    router, seen = sim.policy.router, []
    decide = router.decide
    group = layout.layout.attention_group_ids[0]
    block = layout.layout.groups[group].block_size

    def spy(scored, n, load, candidates, forced=None, by_load=None, host_prices=None, room=None):
        decision = decide(scored, n, load, candidates, forced, by_load, host_prices, room)
        if decision.transfer is not None:
            dst = decision.transfer.dst_replica
            pool = sim.caches[sim.replica_ids.index(dst)].cache.pools[group]
            assert room(dst) == pool.num_free_empty_blocks * block  # that replica's own pool, in tokens
            seen.append((decision.transfer.num_tokens, room(dst), scored.attention_tokens.get(dst, 0)))
        return decision

    router.decide = spy
    records = sim.run(load_trace(DEFAULT_TRACE, limit=1500))
    assert len(records) == 1500
    return seen


def test_transfers_land_only_where_their_pages_fit_into_empty_blocks():
    """Catches: the simulation not handing the router its replicas' room (None: no filter, so the
    default run would equal the evicting one), room counted from free blocks (cached ones
    included: it would never bind) or from another replica's pool, or the filter reading the whole
    hit instead of what the destination lacks (fewer transfers than now)."""
    evicting = planned_transfers(True)
    kept = planned_transfers(False)
    assert sum(room < moved - held for moved, room, held in evicting) >= 2  # landed on full replicas
    assert kept and all(room is not None and room >= moved - held for moved, room, held in kept)
    assert len(kept) < len(evicting)


def test_the_cli_flag_lets_transfers_evict_and_the_summary_says_which(tmp_path):
    """`simulate --transfer-may-evict` moves more pages than the default on the same run, and each
    summary records the setting. Catches: the flag not reaching the router, or a summary that
    cannot tell the two runs apart."""
    from cache_service.trace_sim.cli import main

    def summary(*flag: str) -> dict:
        out = tmp_path / f"s{len(flag)}.json"
        assert main(["--replicas", "16", "--memory-gib", "9.09", "--limit", "1500", "--no-progress",
                     "--out", str(out), *flag]) == 0
        return json.loads(out.read_text())

    default, evicting = summary(), summary("--transfer-may-evict")
    assert (default["transfer_may_evict"], evicting["transfer_may_evict"]) == (False, True)
    assert evicting["num_transfer_tokens"] > default["num_transfer_tokens"] > 0
