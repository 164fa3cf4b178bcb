import pytest

from cache_service import RequestBlockHashes, root_hash


def test_incremental_append_equals_one_shot():
    tokens = list(range(1000))
    whole = RequestBlockHashes(16, tokens)
    parts = RequestBlockHashes(16)
    for start in range(0, 1000, 7):  # uneven pieces cross block boundaries
        parts.append(tokens[start : start + 7])
    assert parts.hashes == whole.hashes
    assert len(whole.hashes) == 1000 // 16
    assert whole.num_tokens == parts.num_tokens == 1000


def test_hashes_are_128_bit_and_chained():
    a = RequestBlockHashes(4, [1, 2, 3, 4, 5, 6, 7, 8])
    b = RequestBlockHashes(4, [9, 9, 9, 9, 5, 6, 7, 8])
    assert all(len(h) == 16 for h in a.hashes)
    assert a.hashes[1] != b.hashes[1]  # same block tokens, different parent


def test_salt_fingerprint_and_extra_keys_change_every_hash():
    tokens = list(range(64))
    base = RequestBlockHashes(16, tokens).hashes
    for kw in ({"cache_salt": "t1"}, {"model_fingerprint": "m2"}, {"extra_keys": ("lora-a",)}):
        other = RequestBlockHashes(16, tokens, **kw).hashes
        assert not set(base) & set(other)
    assert root_hash("m", "s") == root_hash("m", "s") != root_hash("m", None)
    assert root_hash("", "") != root_hash("", "x")


def test_prefix_hash_bounds():
    h = RequestBlockHashes(16, list(range(40)))
    assert h.prefix_hash(32) == h.hashes[1]
    for bad in (0, 8, 48):
        with pytest.raises(ValueError):
            h.prefix_hash(bad)


def test_bad_tokens_are_rejected():
    with pytest.raises(ValueError):
        RequestBlockHashes(4, [1, 2, -3, 4])
    with pytest.raises(ValueError):
        RequestBlockHashes(0)


def test_known_hashes_are_adopted_and_extend_like_computed_ones():
    tokens = list(range(50))
    computed = RequestBlockHashes(16, tokens, cache_salt="s")
    adopted = RequestBlockHashes(16, tokens, cache_salt="s", known=computed.hashes)
    assert adopted.hashes == computed.hashes and adopted.hashes is not computed.hashes
    assert adopted.num_tokens == computed.num_tokens == 50
    for more in ([50, 51], list(range(52, 70))):  # the pending tail (48, 49) completes a block later
        assert adopted.append(more) == computed.append(more)
    assert adopted.hashes == computed.hashes and adopted.num_tokens == 70


def test_known_hashes_must_cover_exactly_the_full_blocks():
    tokens = list(range(48))
    hashes = RequestBlockHashes(16, tokens).hashes
    for bad in (hashes[:2], hashes + hashes[:1]):
        with pytest.raises(ValueError, match="3 full|known hashes"):
            RequestBlockHashes(16, tokens, known=bad)
    exact = RequestBlockHashes(16, tokens + [1], known=hashes)
    assert exact.num_tokens == 49 and exact.append(list(range(15))) == 1
