"""Prefix transfers between tensor-parallel engines (TP 2, rank 1 of each a spawned process, gloo on
loopback; the shipped trained checkpoint): streamed over a real gloo pair channel, every rank's shard
of every page arrives byte for byte (`workers/transfer_rows.py`), the receiver's next request is a
local hit that computes only the rest and decodes as one TP 1 engine; kv-only sends feed a hand-off;
corrupt and TP-mismatched transfers are refused, leave the receiver's pools as they were and leave
the channel usable."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cache_service.block_hash import RequestBlockHashes
from tests.conftest import make_engine
from tests.model.tp_helpers import TRAINED, code_prompts
from workers import transfer_rows
from workers.engine.page_tensors import read_rows, tp_size_of
from workers.engine.sampling_params import SamplingParams
from workers.model.loader import load_model
from workers.tp_worker import launch_local_tp
from workers.transfer import TransferError, export_prefix, import_prefix, page_bytes, wanted_keys
from workers.transfer_channel import PairChannel, StoreHost
from workers.transfer_recv import recv_prefix
from workers.transfer_send import send_prefix

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(400)]

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = code_prompts()[2]  # 387 tokens: six 64-token Mamba pages, 24 full KV blocks of 16 and a partial one
HIT = 384  # floor(386 / 64) * 64: what the receiver's lookup can hit (lossless)
DROP_HIT = 320  # drop: a hit of 384 would need the draft block [384, 400) past the prompt's end


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    a, b = launch_local_tp(str(TRAINED), 2), launch_local_tp(str(TRAINED), 2)
    yield a, b, load_model(TRAINED, kernels="torch")
    a.close()
    b.close()


def _engine(model, eagle: str = "lossless"):
    return make_engine(model, num_spec_tokens=3, eagle_mode=eagle, max_model_len=512, cache_memory_bytes=16 * 2**20)


def _hashes(engine):
    return RequestBlockHashes(engine.cache.layout.hash_block_size, PROMPT,
                              model_fingerprint=engine.config.model_fingerprint)


TP_COMMANDS: list[str] = []  # the thread of every TP command a transfer issued (`_commands_on_the_loop`)


@pytest.fixture(autouse=True)
def _commands_on_the_loop(monkeypatch):
    """Record the thread that issues each TP command of a transfer (`transfer_rows`' gather of
    every rank's rows, its scatter on receipt): `_stream` requires the loop's. A gather moved off
    the loop thread still moves the right bytes here, where nothing else talks to the TP group."""
    TP_COMMANDS.clear()

    def recorded(real):
        def spy(*args, **kwargs):
            TP_COMMANDS.append(threading.current_thread().name)
            return real(*args, **kwargs)
        return spy

    for name in ("read_rows", "write_rows"):
        monkeypatch.setattr(transfer_rows, name, recorded(getattr(transfer_rows, name)))


class _Loop:
    """One thread that issues an engine's TP commands, as the replica's loop thread does (`on_loop`)."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="engine-loop")

    def __call__(self, fn):
        return self.pool.submit(fn).result()


def _channel(name: str) -> tuple[PairChannel, PairChannel, StoreHost]:
    """Both ends of a real gloo pair channel in this process (each end's group forms in its own
    thread: a gloo group waits for its peer)."""
    host, ends = StoreHost("127.0.0.1"), {}

    def open_end(rank: int) -> None:
        ends[rank] = PairChannel(name, rank, host.endpoint, store=host.store if rank == 0 else None)

    threads = [threading.Thread(target=open_end, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return ends[0], ends[1], host


def _stream(src, dst, channel, num_tokens: int = HIT, **send_kw) -> int:
    """`src` streams its prefix of PROMPT to `dst` over `channel` (its sender in a thread); what
    `recv_prefix` returns (or raises). The sender must finish either way (a refusal drains)."""
    sent: dict = {}
    src_loop, dst_loop = _Loop(), _Loop()

    def send() -> None:
        try:
            sent["bytes"] = send_prefix(src.cache, _hashes(src), num_tokens, channel[0], on_loop=src_loop, **send_kw)
        except Exception as exc:  # noqa: BLE001 - reported below
            sent["error"] = exc

    sender = threading.Thread(target=send)
    sender.start()
    try:
        return recv_prefix(dst.cache, channel[1], on_loop=dst_loop)
    finally:
        sender.join(timeout=120)
        src_loop.pool.shutdown()
        dst_loop.pool.shutdown()
        assert not sender.is_alive() and "error" not in sent, sent
        assert TP_COMMANDS or tp_size_of(src.cache) == 1  # a TP n sender gathers
        assert all(t.startswith("engine-loop") for t in TP_COMMANDS), TP_COMMANDS


def _rows(engine, wanted) -> list[tuple[torch.Tensor, ...]]:
    """Every rank's rows (and the sidecar) of the cached pages `wanted` per group, as a transfer moves them."""
    cache = engine.cache
    return [read_rows(cache, g, [cache.pools[g].cached[k].block_id for k in keys], sidecar=True) if keys else ()
            for g, keys in enumerate(wanted)]


def _assert_same_pages(a, b, kv_only: bool = False, hit: int = HIT) -> None:
    """b holds a's pages of the transfer, on every rank, byte for byte. Rank 0's and rank 1's shards
    differ, so rows landed on the wrong rank (or only rank 0's written) fail."""
    wanted = wanted_keys(a.cache, _hashes(a), hit, kv_only)
    got, want = _rows(b, wanted), _rows(a, wanted)
    full = [g for g, spec in enumerate(a.cache.layout.groups) if spec.kind == "full"][0]
    per_rank = (len(want[full]) - 1) // 2  # rank 0's tensors, rank 1's, the sidecar
    assert not torch.equal(want[full][0], want[full][per_rank])
    for g, (x, y) in enumerate(zip(got, want)):
        assert len(x) == len(y)
        for i, (u, v) in enumerate(zip(x, y)):
            assert torch.equal(u, v), f"group {g} page tensor {i} differs"


def _pool_state(engine) -> list[tuple[int, int]]:
    return [(p.num_free_blocks, p.num_cached_blocks) for p in engine.cache.pools]


@pytest.mark.parametrize("eagle, chunk_bytes", [("lossless", 4 * 2**20), ("drop", 3000)],
                         ids=["lossless-one-chunk-per-tensor", "drop-many-small-chunks"])
def test_a_tp2_prefix_streams_to_a_tp2_engine_and_serves_a_local_hit(models, eagle, chunk_bytes):
    """A corrupt stream is refused with B's pools as before; the clean resend over the same channel
    lands every rank's pages byte for byte, and B's request is a hit computing only the rest, its
    greedy output a TP 1 engine's. Catches: only rank 0's shard sent or written, shards swapped,
    a sidecar or draft page left behind, pages registered but not written, a receiver that
    recomputes, a corrupt transfer registered."""
    tp_a, tp_b, tp1 = models
    hit = HIT if eagle == "lossless" else DROP_HIT
    (ref,) = _engine(tp1, eagle).generate([PROMPT], PARAMS)
    a, b = _engine(tp_a, eagle), _engine(tp_b, eagle)
    (cold,) = a.generate([PROMPT], PARAMS)
    assert cold.token_ids == ref.token_ids
    channel = _channel(f"tp-{eagle}")
    before = _pool_state(b)
    with pytest.raises(TransferError, match="checksum"):
        _stream(a, b, channel, hit, corrupt=True, chunk_bytes=chunk_bytes)
    assert _pool_state(b) == before
    b.cache.check_integrity()
    stored = _stream(a, b, channel, hit, chunk_bytes=chunk_bytes)
    assert stored == sum(len(keys) for keys in wanted_keys(a.cache, _hashes(a), hit))
    b.cache.check_integrity()
    a.cache.check_integrity()  # the sender's pins were released
    _assert_same_pages(a, b, hit=hit)
    (warm,) = b.generate([PROMPT], PARAMS)
    assert warm.num_cached_tokens == hit and warm.num_computed_prompt_tokens == len(PROMPT) - hit
    assert b.num_computed_prompt_tokens == len(PROMPT) - hit
    assert warm.token_ids == ref.token_ids


def test_kv_only_pages_sent_ahead_are_shared_by_a_tp2_hand_off(models):
    """A kv-only send of the prompt's attention blocks (no Mamba page) while A holds the request,
    then the hand-off: B's hit is the sent blocks (it writes only the rest of the package) and it
    decodes as one TP 1 engine without computing a prompt token. Catches: kv-only pages written to
    rank 0 only or registered unwritten (bytes compared, output), a Mamba page sent along."""
    tp_a, tp_b, tp1 = models
    (ref,) = _engine(tp1).generate([PROMPT], PARAMS)
    a, b = _engine(tp_a), _engine(tp_b)
    rid = a.add_request(PROMPT, PARAMS)
    while not a.requests[rid].output_token_ids:
        a.step()
    stored = _stream(a, b, _channel("tp-kv-only"), kv_only=True)
    mamba = [g for g, spec in enumerate(b.cache.layout.groups) if spec.kind == "mamba"]
    assert stored == sum(len(keys) for keys in wanted_keys(a.cache, _hashes(a), HIT, kv_only=True))
    assert all(b.cache.pools[g].num_cached_blocks == 0 for g in mamba)
    _assert_same_pages(a, b, kv_only=True)
    handoff = a.export_request(rid)
    result = b.import_request(handoff)
    full = [g for g, spec in enumerate(b.cache.layout.groups) if spec.kind == "full"][0]
    # the hit is the sent blocks: only the partial block past them is written (every rank's shard)
    assert result.num_hit_tokens == HIT and 0 < result.num_bytes_written < handoff.nbytes
    assert result.num_pages_written[full] == len(handoff.pages[full][0]) - HIT // b.cache.block_size
    while True:
        outs = [o for o in b.step() if o.request_id == rid and o.finished]
        if outs:
            break
    assert outs[0].token_ids == ref.token_ids and b.num_computed_prompt_tokens == 0


def test_a_transfer_between_tp_sizes_is_refused_by_name_and_the_channel_stays_usable(models):
    """TP 2 -> TP 1 and TP 1 -> TP 2, streamed and in memory: refused naming tp_size, the receiver's
    pools unchanged; the next transfer over the same channel (of the right TP size) succeeds, so the
    refused one was drained whole."""
    tp_a, tp_b, tp1 = models
    a, b, one, other = _engine(tp_a), _engine(tp_b), _engine(tp1), _engine(tp1)
    a.generate([PROMPT], PARAMS)
    one.generate([PROMPT], PARAMS)
    # (wrong sender, receiver, right sender): refused by name, nothing stored, the channel still works
    for wrong, dst, right, sizes in ((a, other, one, (2, 1)), (one, b, a, (1, 2))):
        channel = _channel(f"tp{sizes[0]}-to-tp{sizes[1]}")
        before = _pool_state(dst)
        with pytest.raises(TransferError, match=f"incompatible transfer: tp_size is {sizes[0]}, here {sizes[1]}"):
            _stream(wrong, dst, channel)
        assert _pool_state(dst) == before
        assert _stream(right, dst, channel) > 0
    _assert_same_pages(a, b)
    header, payload = export_prefix(a.cache, _hashes(a), HIT)
    assert header.tp_size == 2 and payload.numel() == page_bytes(a.cache).of(HIT)  # every rank's shard priced
    with pytest.raises(TransferError, match="incompatible transfer: tp_size is 2, here 1"):
        import_prefix(_engine(tp1).cache, header, payload)
    fresh = _engine(tp_b)
    assert import_prefix(fresh.cache, header, payload) == sum(len(keys) for keys in header.keys)
    _assert_same_pages(a, fresh)
    (warm,) = fresh.generate([PROMPT], PARAMS)
    assert warm.num_cached_tokens == HIT and fresh.num_computed_prompt_tokens == len(PROMPT) - HIT


def test_a_receiver_holding_part_of_the_prefix_gets_only_the_rest_written_where_it_belongs(models):
    """B served the prompt's first 200 tokens itself, so it holds part of the pages A sends: only
    the others are stored, each of them lands on every rank equal to A's, B's own pages are left
    byte for byte as they were, and its next request hits the whole prefix with a TP 1 engine's
    output. Catches: staged rows mapped to the wrong pages once some rows are skipped, pages B held
    overwritten or counted again."""
    tp_a, tp_b, tp1 = models
    (ref,) = _engine(tp1).generate([PROMPT], PARAMS)
    a, b = _engine(tp_a), _engine(tp_b)
    a.generate([PROMPT], PARAMS)
    b.generate([PROMPT[:200]], PARAMS)
    wanted = wanted_keys(a.cache, _hashes(a), HIT)
    held = [[k for k in keys if k in b.cache.pools[g].cached] for g, keys in enumerate(wanted)]
    fresh = [[k for k in keys if k not in b.cache.pools[g].cached] for g, keys in enumerate(wanted)]
    assert sum(map(len, held)) > 0 and all(fresh)  # some of every group is missing, some pages held
    own = _rows(b, held)
    stored = _stream(a, b, _channel("tp-partial"))
    assert stored == sum(map(len, fresh))
    b.cache.check_integrity()
    for g, (x, y) in enumerate(zip(_rows(b, held), own)):
        assert all(torch.equal(u, v) for u, v in zip(x, y)), f"group {g}: a page B held was rewritten"
    for g, (x, y) in enumerate(zip(_rows(b, fresh), _rows(a, fresh))):
        assert len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y)), f"group {g} differs"
    (warm,) = b.generate([PROMPT], PARAMS)
    assert warm.num_cached_tokens == HIT and warm.num_computed_prompt_tokens == len(PROMPT) - HIT
    assert warm.token_ids == ref.token_ids
