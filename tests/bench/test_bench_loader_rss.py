import json

import pytest

from bench.loader_rss import main


@pytest.mark.heavy
@pytest.mark.long  # ~13 s, the whole benchmark: make long
def test_loader_rss_benchmark_small(capsys):
    """The benchmark runs end to end on a small multi-shard checkpoint and every mode reports a peak."""
    assert main(["--small", "--shard-mib", "4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_shards"] >= 3
    modes = report["modes"]
    assert set(modes) == {"eager_fp32_to_bf16", "stream_fp32", "stream_bf16", "stream_bf16_tp2"}
    assert all(m["peak_rss_mib"] > 0 for m in modes.values())
