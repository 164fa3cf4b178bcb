"""`python -m bench.host_tier_ttft` on a short prompt, one round: each case is served from the tier it
names (the property; its timings are not judged), the table and the report carry every case."""

import json

import pytest

from bench.host_tier_ttft import CASES, main


@pytest.mark.parametrize("spec_tokens", [0, 3])
def test_each_case_is_served_from_its_own_tier(tiny_dir, tmp_path, capsys, spec_tokens):
    """Catches: a 'host' case whose pages were still on the device (nothing promoted, or a hit not
    counted as the host's), a 'device' case that promoted, a 'recompute' case that hit, a case
    missing from the table or the report."""
    out = tmp_path / "r.json"
    assert main(["--model", tiny_dir, "--prompt-len", "130", "--repeats", "1", "--spec-tokens", str(spec_tokens),
                 "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    report = json.loads(out.read_text())
    price = report["price"]  # None when the noisy one-round TTFTs give no recompute rate
    if price is not None:
        assert lines.pop().startswith(f"host copy priced {price['priced_tokens']:g} recomputed tokens")
        assert price["priced_tokens"] == pytest.approx(price["fixed"] + price["per_token"] * 128, abs=0.02)
    assert lines[-5].split() == ["case", "TTFT", "ms", "hit", "tok", "host", "hit", "computed", "promoted", "demoted"]
    assert [line.split()[0] for line in lines[-4:-1]] == list(CASES)
    assert lines[-1].startswith("host / device ") and " host / recompute " in lines[-1]
    device, host, recompute = (report["cases"][c] for c in CASES)
    hit = 128  # floor(129 / 64) * 64 (drafts in the prompt: no drop in lossless mode)
    assert (recompute["hit_tokens"], recompute["promoted_pages"], recompute["computed_tokens"]) == (0, 0, 130)
    assert (device["hit_tokens"], device["host_hit_tokens"], device["promoted_pages"]) == (hit, 0, 0)
    assert (host["hit_tokens"], host["host_hit_tokens"]) == (hit, hit) and host["computed_tokens"] == 130 - hit
    assert host["promoted_pages"] >= hit // 16 + 1  # every KV block of the hit and its Mamba state
    assert report["num_flood_prompts"][0] >= 1 and report["host_cache_bytes"] == 8 * report["cache_memory_bytes"]
    assert all(len(report["cases"][c]["ttft_ms_all"]) == 1 and report["cases"][c]["ttft_ms"] > 0 for c in CASES)
    assert len(report["rounds"]) == 1 and report["rounds"][0]["host"]["promoted_pages"] == host["promoted_pages"]
    assert set(report["ratios"]) == {"host_over_device", "host_over_recompute"}


@pytest.mark.parametrize("argv", [["--prompt-len", "64"], ["--repeats", "0"], ["--spec-tokens", "-1"],
                                  ["--threads", "0"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        main(argv)
