import json

from bench.lookup import main


def test_lookup_benchmark_reports_a_full_hit(capsys):
    assert main(["--tokens", "4096", "--repeats", "5"]) == 0
    report = json.loads(capsys.readouterr().out)
    # 4096 tokens, A = lcm(64, 64, 256, 64) = 256; cap 4095 -> R = 3840; drop (lookahead): the
    # draft block [3840, 3904) lies inside the prompt -> 3840 (the alignment rule gave 3584)
    assert report["hit_tokens"] == 3840
    assert report["num_hash_blocks"] == 64
    assert report["total_ms_median"] > 0
