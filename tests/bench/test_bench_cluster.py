import json

from bench.cluster import main


def test_routing_benchmark_small(capsys):
    assert main(["--entries", "20000", "--replicas", "4", "--prompt-len", "2048", "--repeats", "10"]) == 0
    report = json.loads(capsys.readouterr().out)["routing"]
    assert report["num_indexed_entries"] >= 20000
    assert report["expected_hit_tokens"] > 0 and report["p99_ms"] > 0
