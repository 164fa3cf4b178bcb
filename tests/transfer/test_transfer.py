"""Prefix pages move between replicas and serve a normal, byte-exact local hit there."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cache_service.block_hash import RequestBlockHashes
from tests.conftest import make_engine, make_prompt
from workers.engine.sampling_params import SamplingParams
from workers.transfer import TransferError, export_prefix, import_prefix, page_bytes
from workers.transfer_channel import WorldChannel
from workers.transfer_recv import recv_prefix
from workers.transfer_send import send_prefix

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _hashes(engine, prompt):
    return RequestBlockHashes(engine.cache.layout.hash_block_size, prompt,
                              model_fingerprint=engine.config.model_fingerprint)


@pytest.mark.parametrize("eagle", ["drop", "lossless"])
def test_transferred_prefix_is_a_local_hit_with_identical_output(tiny_model, eagle):
    src, dst = (make_engine(tiny_model, num_spec_tokens=3, eagle_mode=eagle) for _ in range(2))
    prompt = make_prompt(500, 3)
    (cold,) = src.generate([prompt], PARAMS)
    hit = 448  # R = floor(499 / 64) * 64; drop: the draft block [448, 464) proves the successor token
    header, payload = export_prefix(src.cache, _hashes(src, prompt), hit)
    # what the front door prices the transfer at (`link_costs`): exact, but for drop's extra draft block
    pages = page_bytes(src.cache)
    extra = payload.numel() * payload.element_size() - pages.of(hit)
    assert extra == 0 if eagle == "lossless" else 0 < extra < pages.per_token * src.cache.block_size
    assert import_prefix(dst.cache, header, payload) == sum(len(keys) for keys in header.keys)
    dst.cache.check_integrity()
    before = tiny_model.forward_counts.num_prompt_tokens
    (warm,) = dst.generate([prompt], PARAMS)
    assert warm.num_cached_tokens == hit and warm.token_ids == cold.token_ids
    # the moved pages are used, not recomputed: only the prompt's last 500 - 448 tokens go through the model
    assert warm.num_computed_prompt_tokens == dst.num_computed_prompt_tokens == 500 - hit
    assert tiny_model.forward_counts.num_prompt_tokens - before == 500 - hit
    assert import_prefix(dst.cache, header, payload) == 0  # already there: nothing new stored


def test_corrupt_or_incompatible_transfers_are_refused(tiny_model):
    src = make_engine(tiny_model, num_spec_tokens=0)
    prompt = make_prompt(300, 4)
    src.generate([prompt], PARAMS)
    header, payload = export_prefix(src.cache, _hashes(src, prompt), 256)
    bad = payload.clone()
    bad[100] ^= 0xFF
    dst = make_engine(tiny_model, num_spec_tokens=0)
    with pytest.raises(TransferError, match="checksum"):
        import_prefix(dst.cache, header, bad)
    with pytest.raises(TransferError, match="tp_size"):
        import_prefix(dst.cache, header, payload, tp_size=2)
    other = make_engine(tiny_model, num_spec_tokens=0, kv_block_size=32)
    with pytest.raises(TransferError, match="kv_block_size"):
        import_prefix(other.cache, header, payload)
    with pytest.raises(TransferError, match="not cached"):
        export_prefix(src.cache, _hashes(src, make_prompt(300, 5)), 256)
    assert dst.cache.pools[0].num_cached_blocks == 0  # nothing half-registered
    (warm,) = dst.generate([prompt], PARAMS)
    assert warm.num_cached_tokens == 0 and warm.num_computed_prompt_tokens == 300  # fell back to recompute


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, port, model_dir, queue, chunk_bytes):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        from workers.engine.config import EngineConfig
        from workers.engine.engine import LLMEngine

        engine = LLMEngine.from_checkpoint(model_dir, EngineConfig(kernels="torch", max_model_len=2048,
                                                                  cache_memory_bytes=64 * 2**20))
        prompt = make_prompt(600, 8)
        if rank == 0:
            (cold,) = engine.generate([prompt], PARAMS)
            send_prefix(engine.cache, _hashes(engine, prompt), 576, WorldChannel(1), chunk_bytes=chunk_bytes)
            queue.put(("src", list(cold.token_ids), cold.num_cached_tokens,
                       engine.model.forward_counts.num_prompt_tokens))
        else:
            stored = recv_prefix(engine.cache, WorldChannel(0))
            assert stored > 0
            engine.cache.check_integrity()
            (warm,) = engine.generate([prompt], PARAMS)
            queue.put(("dst", list(warm.token_ids), warm.num_cached_tokens,
                       engine.model.forward_counts.num_prompt_tokens))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("chunk_bytes", [4 * 2**20, 3000])  # one chunk per tensor; many small chunks
def test_rank_to_rank_over_gloo_on_loopback(tiny_dir, chunk_bytes):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = [ctx.Process(target=_worker, args=(r, port, tiny_dir, queue, chunk_bytes)) for r in range(2)]
    for p in procs:
        p.start()
    got = [queue.get(timeout=150) for _ in range(2)]
    results = {name: (tokens, hit, computed) for name, tokens, hit, computed in got}
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert results["src"][1] == 0 and results["dst"][1] == 576
    assert results["src"][2] == 600 and results["dst"][2] == 600 - 576  # the receiver's model ran only the rest
    assert results["dst"][0] == results["src"][0]


class _ThreadChannel:
    """In-process pair of queues standing in for a gloo pair (unit isolation of the stream logic);
    `corrupt` flips a byte of the n-th tensor sent."""

    def __init__(self, outbox, inbox, corrupt: int | None = None) -> None:
        self.outbox, self.inbox, self.corrupt, self.sent = outbox, inbox, corrupt, 0

    class _Done:
        def wait(self):
            return True

    def isend(self, tensor):
        data = tensor.clone()
        if self.sent == self.corrupt:
            data.view(torch.uint8)[0] ^= 0xFF
        self.sent += 1
        self.outbox.put(data)
        return self._Done()

    def irecv(self, tensor):
        chan = self

        class _Pending:
            def wait(self):
                tensor.copy_(chan.inbox.get(timeout=30))
                return True

        return _Pending()


def _pair(corrupt=None):
    import queue

    a, b = queue.Queue(), queue.Queue()
    return _ThreadChannel(a, b, corrupt), _ThreadChannel(b, a)


@pytest.mark.parametrize("eagle", ["drop", "lossless"])
def test_streamed_transfer_refuses_corruption_and_the_channel_stays_usable(tiny_model, eagle):
    import threading

    src, dst = (make_engine(tiny_model, num_spec_tokens=3, eagle_mode=eagle) for _ in range(2))
    prompt = make_prompt(500, 11)
    (cold,) = src.generate([prompt], PARAMS)
    hit = 448  # R = floor(499 / 64) * 64; drop: the draft block [448, 464) proves the successor token
    for corrupt, expect in ((3, "checksum"), (None, None)):  # chunk #1 corrupted, then a clean resend
        send_end, recv_end = _pair(corrupt)
        sender = threading.Thread(target=send_prefix, args=(src.cache, _hashes(src, prompt), hit, send_end),
                                  kwargs={"chunk_bytes": 5000})
        sender.start()
        if expect:
            with pytest.raises(TransferError, match=expect):
                recv_prefix(dst.cache, recv_end)
            assert all(p.num_cached_blocks == 0 for p in dst.cache.pools)  # nothing half-registered
        else:
            assert recv_prefix(dst.cache, recv_end) > 0
        sender.join(timeout=30)
        dst.cache.check_integrity()
        src.cache.check_integrity()  # the sender's pins were released
    (warm,) = dst.generate([prompt], PARAMS)
    assert warm.num_cached_tokens == hit and warm.token_ids == cold.token_ids
    assert warm.num_computed_prompt_tokens == 500 - hit


def test_streamed_transfer_to_an_incompatible_replica_is_refused_after_draining(tiny_model):
    import threading

    src = make_engine(tiny_model, num_spec_tokens=0)
    other = make_engine(tiny_model, num_spec_tokens=0, kv_block_size=32)
    prompt = make_prompt(300, 12)
    src.generate([prompt], PARAMS)
    send_end, recv_end = _pair()
    sender = threading.Thread(target=send_prefix, args=(src.cache, _hashes(src, prompt), 256, send_end))
    sender.start()
    with pytest.raises(TransferError, match="kv_block_size"):
        recv_prefix(other.cache, recv_end)
    sender.join(timeout=30)
    assert not sender.is_alive() and recv_end.inbox.empty()  # every chunk was drained


@pytest.mark.parametrize("streamed", [False, True])
def test_a_transfer_is_served_from_the_holders_host_tier(tiny_model, streamed):
    """The holder's pages were demoted to its host tier: the transfer promotes them and moves them;
    the receiver's hit is byte-identical and computes only the rest (catches: a sender that reads
    only device pages and refuses, or sends another slot's bytes)."""
    import threading

    config = dict(num_spec_tokens=3, eagle_mode="lossless", max_model_len=512, cache_memory_bytes=8 * 2**20,
                  mamba_memory_fraction=0.75)
    src = make_engine(tiny_model, host_cache_bytes=24 * 2**20, **config)
    dst = make_engine(tiny_model, **config)
    prompt = make_prompt(300, 21)
    (cold,) = src.generate([prompt], PARAMS)
    for i in range(4):
        src.generate([make_prompt(300, 300 + i)], PARAMS)
    hashes, hit = _hashes(src, prompt), 256
    assert hashes.prefix_hash(hit) not in src.cache.pools[1].cached  # the state is on the host only
    if streamed:
        send_end, recv_end = _pair()
        sender = threading.Thread(target=send_prefix, args=(src.cache, hashes, hit, send_end))
        sender.start()
        assert recv_prefix(dst.cache, recv_end) > 0
        sender.join(timeout=30)
    else:
        assert import_prefix(dst.cache, *export_prefix(src.cache, hashes, hit)) > 0
    assert src.cache.host_stats()["num_host_promoted_pages"] > 0
    src.cache.check_integrity()
    (warm,) = dst.generate([prompt], PARAMS)
    assert warm.num_cached_tokens == hit and warm.token_ids == cold.token_ids
    assert warm.num_computed_prompt_tokens == 300 - hit


def test_tp1_sends_from_and_receives_into_the_cache_tensors_themselves(tiny_model, monkeypatch):
    """TP 1 is zero copy (`transfer_rows`): the sender's chunk sources are the engine's own page
    tensors with the pages' block ids as rows, and a streamed transfer's chunks land in the
    receiver's cache storage itself. A change that gathered or staged copies at TP 1 (as TP n
    must) would pass every byte-exact test and fail this one."""
    import threading

    from workers import transfer_recv
    from workers.transfer_rows import group_tensors, send_sources

    src, dst = (make_engine(tiny_model, num_spec_tokens=0) for _ in range(2))
    groups = len(src.cache.layout.groups)
    ids = [[1, 2, 3] if g == 0 else [1] for g in range(groups)]
    tensors, rows = send_sources(src.cache, ids)
    assert rows == ids
    for g in range(groups):
        own = group_tensors(src.cache, g)
        assert [t.data_ptr() for t in tensors[g]] == [t.data_ptr() for t in own]
        assert [t.shape for t in tensors[g]] == [t.shape for t in own]
    landed = []
    target = transfer_recv._Landing.target

    def spy(self, k, nbytes):
        out = target(self, k, nbytes)
        landed.append((self.staged, out))
        return out

    monkeypatch.setattr(transfer_recv._Landing, "target", spy)
    prompt = make_prompt(300, 4)
    (cold,) = src.generate([prompt], PARAMS)
    send_end, recv_end = _pair()
    sender = threading.Thread(target=send_prefix, args=(src.cache, _hashes(src, prompt), 256, send_end))
    sender.start()
    assert recv_prefix(dst.cache, recv_end) > 0
    sender.join(timeout=30)
    storages = {t.untyped_storage().data_ptr() for g in range(groups) for t in group_tensors(dst.cache, g)}
    # a fresh receiver's pages are consecutive runs: every chunk lands in place, none via a buffer
    assert landed and not any(staged for staged, _ in landed)
    assert all(direct and buf.untyped_storage().data_ptr() in storages for _, (buf, direct) in landed)
    (warm,) = dst.generate([prompt], PARAMS)
    assert warm.num_cached_tokens == 256 and warm.token_ids == cold.token_ids
