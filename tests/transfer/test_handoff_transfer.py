"""A prefill/decode hand-off between two ranks over a real gloo pair channel on loopback
(`workers/handoff_transfer.py`): B decodes as one engine would, running no prompt token; a
corrupted chunk, a refusing receiver or a stream cut mid-way raise typed errors, import nothing on
B, and the request finishes on A as on one engine (nothing lost).

The ranks are two threads of this process, each with its own `PairChannel` (`ProcessGroupGloo`
over a `TCPStore`), as in tests/cluster/test_isolation.py: real sockets, no spawned interpreters."""

import dataclasses
import json
import os
import threading

import pytest
import torch
import xxhash

from tests.conftest import make_prompt
from tests.engine.test_handoff import assert_same_pages, engine_for, finish, prefill, request_pages
from workers.engine.errors import HandoffError
from workers.engine.sampling import TokenLogprobs
from workers.engine.sampling_params import SamplingParams
from workers.handoff_codec import HandoffMetaError, decode_meta, encode_meta
from workers.handoff_transfer import (
    HandoffRefused,
    HandoffStreamCorrupt,
    HandoffStreamTruncated,
    hand_off_or_keep,
    receive_handoff_into,
    recv_handoff,
    send_handoff,
)
from workers.transfer_channel import PairChannel, StoreHost

PROMPT = [(7 * i + 3) % 512 for i in range(100)]  # 6 full blocks of 16 and a partial one; alignment 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
CHUNK = 4096  # small: a page tensor spans several chunks


def channel_pair(timeout_s: float = 10.0) -> tuple[PairChannel, PairChannel]:
    """Rank 0 (A's end) and rank 1 (B's end) of one gloo pair; both must join at once."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    host = StoreHost("127.0.0.1", timeout_s=timeout_s)
    ends: list = [None, None]

    def join(rank: int) -> None:
        ends[rank] = PairChannel("handoff", rank, host.endpoint, store=host.store if rank == 0 else None,
                                 timeout_s=timeout_s)  # rank 1: its own store client, as a peer process

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(ends), "the pair channel did not form"
    return ends[0], ends[1]


def receiving(engine, channel) -> tuple[threading.Thread, dict]:
    """B's rank: `receive_handoff_into` on a thread; its result or exception lands in the dict."""
    got: dict = {}

    def run() -> None:
        try:
            got["result"] = receive_handoff_into(engine, channel)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            got["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, got


def hand_off_over_gloo(a, b, rid: str):
    """Export `rid` from A and send it to B over a fresh gloo pair: (A's pages of it before the
    export, the package, what the sender got back, what B's receiving thread got)."""
    pages = request_pages(a, rid)
    handoff = a.export_request(rid)
    end_a, end_b = channel_pair()
    thread, got = receiving(b, end_b)
    sent = send_handoff(end_a, handoff, chunk_bytes=CHUNK)
    thread.join(timeout=30)
    return pages, handoff, sent, got


def one_engine(model, k, eagle, params=GREEDY, cache={}):  # noqa: B006 - memo across tests of this module
    """The reference: the request on one engine (its final output)."""
    if (k, eagle, params) not in cache:
        ref = engine_for(model, k, eagle)
        cache[k, eagle, params] = finish(ref, prefill(ref, PROMPT, params=params))[0]
    return cache[k, eagle, params]


def test_the_meta_survives_json_exactly_and_garbage_is_refused(tiny_model):
    """Catches: a field dropped or renamed by the codec, lists left as lists (the frozen meta would
    differ and not hash), a float rounded or -inf lost, a NamedTuple / nested dataclass rebuilt as
    a plain tuple or dict; and a decoder that accepts a wrong type or an unknown field."""
    a = engine_for(tiny_model, 3, "lossless")
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=4, logprobs=2, stop=("ab", "c"), stop_token_ids=(9,))
    rid = prefill(a, PROMPT, params=params)
    meta = a.export_request(rid).meta
    odd = TokenLogprobs(-1 / 3, ((4, -float("inf")),))  # a float JSON must not round, an -inf it must keep
    meta = dataclasses.replace(meta, output_logprobs=(*meta.output_logprobs, odd))
    assert meta.cache_report is not None and meta.sampler_seed == 5 and len(meta.output_logprobs) == 2
    wire = json.loads(json.dumps(encode_meta(meta)))
    back = decode_meta(wire)
    assert back == meta and hash(back.params) == hash(meta.params)
    assert type(back.output_logprobs[0]) is TokenLogprobs and type(back.cache_report) is type(meta.cache_report)
    for path, bad in ((("num_computed_tokens",), True), (("params", "temperature"), "0.7"),
                      (("engine", "group_kinds"), "full"), (("params", "evil"), 1)):
        data = json.loads(json.dumps(wire))
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = bad
        with pytest.raises(HandoffMetaError, match=path[-1] if path[-1] != "evil" else "is not a"):
            decode_meta(data)


@pytest.mark.parametrize("k, eagle, params", [(0, "lossless", GREEDY), (3, "drop", GREEDY),
                                             (3, "lossless", GREEDY), (3, "lossless", SEEDED)],
                         ids=["k0", "k3-drop", "k3-lossless", "k3-lossless-seeded"])
def test_a_hand_off_over_gloo_decodes_as_on_one_engine(tiny_model, k, eagle, params):
    """Catches: a chunk landing at the wrong offset or a tensor reassembled in the wrong group or
    order (B's pages are compared with A's byte for byte), a lost sampler state (the seeded
    temperature-1 case draws differently) or lost drafts (the tokens and draft counters equal one
    engine's), and a receiver that recomputes the prompt."""
    ref = one_engine(tiny_model, k, eagle, params)
    a, b = engine_for(tiny_model, k, eagle), engine_for(tiny_model, k, eagle)
    rid = prefill(a, PROMPT, params=params)
    pages, handoff, sent, got = hand_off_over_gloo(a, b, rid)
    assert "error" not in got and got["result"].num_bytes_written == handoff.nbytes  # B held nothing
    state = handoff.sampler_state
    assert (state is None) == (params is GREEDY)  # greedy: no generator
    assert sent.num_payload_bytes == handoff.nbytes + (0 if state is None else state.numel())
    assert sent.num_chunks > sum(len(group) for group in handoff.pages)
    assert sent.num_skipped_bytes == 0 and not any(sent.first_rows)
    assert_same_pages(request_pages(b, rid), pages)
    out, _ = finish(b, rid)
    assert out.token_ids == ref.token_ids
    assert (out.num_draft_proposed, out.num_draft_accepted) == (ref.num_draft_proposed, ref.num_draft_accepted)
    assert b.num_computed_prompt_tokens == 0


@pytest.mark.parametrize("k, eagle", [(0, "lossless"), (3, "drop"), (3, "lossless")])
def test_a_decoder_holding_the_prefix_is_sent_only_the_rows_it_lacks(tiny_model, k, eagle):
    """B first served a prompt sharing 80 tokens (a 64-token hit): B answers the header with the
    rows its hit holds and A sends only the rest, so the bytes on the wire are the package's less
    those rows, counted. Catches: a sender that streams the whole package anyway (payload bytes), a
    receiver that asks for rows its hit does not hold (B's pages then differ from A's, or the
    output does), a lossless draft block at 63 skipped (B holds a copy that must be rewritten),
    and a reservation left behind (the pools' integrity after the decode)."""
    ref = one_engine(tiny_model, k, eagle)
    a, b = engine_for(tiny_model, k, eagle), engine_for(tiny_model, k, eagle)
    b.generate([PROMPT[:80] + make_prompt(40, 99)], SamplingParams(temperature=0.0, max_tokens=2))
    before = b.num_computed_prompt_tokens
    pages, handoff, sent, got = hand_off_over_gloo(a, b, prefill(a, PROMPT))
    rid, imported = handoff.meta.request_id, got["result"]
    assert imported.num_hit_tokens == 64
    # the rows B's hit holds: 4 target blocks, no Mamba row (the working state is always sent),
    # 4 draft blocks (lossless: 3, the block holding position 63 is sent again)
    assert sent.first_rows == ((4, 0) if not k else (4, 0, 3 if eagle == "lossless" else 4))
    row_bytes = [sum(t[0].numel() * t.element_size() for t in group) for group in handoff.pages]
    skipped = sum(n * b_ for n, b_ in zip(sent.first_rows, row_bytes))
    assert skipped > 0 and sent.num_skipped_bytes == skipped
    assert sent.num_payload_bytes == handoff.nbytes - skipped == imported.num_bytes_written
    assert_same_pages(request_pages(b, rid), pages)
    out, _ = finish(b, rid)
    assert out.token_ids == ref.token_ids and b.num_computed_prompt_tokens == before


def test_a_corrupted_chunk_after_a_reservation_gives_the_pages_back(tiny_model):
    """B holds the prefix (a reservation that shares its cached blocks) and a chunk arrives corrupt:
    B frees what it reserved (no request, the pools intact, its cached prefix still a hit for the
    clean resend) and A keeps the request. Catches: a receiver that cancels nothing (leaked pages,
    a request id then "already on this engine" at the resend)."""
    ref = one_engine(tiny_model, 3, "lossless")
    a, b = engine_for(tiny_model, 3, "lossless"), engine_for(tiny_model, 3, "lossless")
    b.generate([PROMPT[:80] + make_prompt(40, 99)], SamplingParams(temperature=0.0, max_tokens=2))
    free = b.cache.num_free_kv_blocks
    rid = prefill(a, PROMPT)
    handoff = a.export_request(rid)
    end_a, end_b = channel_pair()
    thread, got = receiving(b, end_b)
    delivery = hand_off_or_keep(a, handoff, lambda h: send_handoff(end_a, h, chunk_bytes=CHUNK, corrupt_chunk=2))
    thread.join(timeout=30)
    assert isinstance(got["error"], HandoffStreamCorrupt) and not delivery.delivered
    assert not b.requests
    b.cache.check_integrity()
    assert b.cache.num_free_kv_blocks == free
    thread, got = receiving(b, end_b)  # the same package again, clean: B's prefix is still a hit
    a.abort(rid)
    send_handoff(end_a, handoff, chunk_bytes=CHUNK)
    thread.join(timeout=30)
    assert got["result"].num_hit_tokens == 64
    assert finish(b, rid)[0].token_ids == ref.token_ids


def lossless_pair(tiny_model, receiver_eagle: str):
    """A k=3 lossless request exported from A after its first token, a channel pair, and B (k=3,
    `receiver_eagle`) receiving on its end in a thread: (one engine's output, A, B, request id,
    package, A's end, B's end, the thread, what it got)."""
    ref = one_engine(tiny_model, 3, "lossless")
    a, b = engine_for(tiny_model, 3, "lossless"), engine_for(tiny_model, 3, receiver_eagle)
    rid = prefill(a, PROMPT)
    handoff = a.export_request(rid)
    end_a, end_b = channel_pair()
    thread, got = receiving(b, end_b)
    return ref, a, b, rid, handoff, end_a, end_b, thread, got


def test_a_corrupted_chunk_is_refused_and_the_request_finishes_on_a(tiny_model):
    """Catches: a receiver that imports without checking every chunk, a sender that ignores the
    receiver's no (no fallback: the request would be lost), a fallback that recomputes the prompt,
    and a receiver that leaves the channel mid-stream on a bad chunk (the clean resend after it
    on the same channel would hang or mismatch)."""
    ref, a, b, rid, handoff, end_a, end_b, thread, got = lossless_pair(tiny_model, "lossless")
    delivery = hand_off_or_keep(a, handoff, lambda h: send_handoff(end_a, h, chunk_bytes=CHUNK, corrupt_chunk=5))
    thread.join(timeout=30)
    assert isinstance(got["error"], HandoffStreamCorrupt) and "[5]" in str(got["error"])
    assert not delivery.delivered and "HandoffRefused" in delivery.failure and "checksum" in delivery.failure
    assert not b.requests and b.num_computed_prompt_tokens == 0
    b.cache.check_integrity()
    assert delivery.kept.num_hit_tokens == 64  # A's own cached prompt serves the re-import
    out, _ = finish(a, rid)
    assert out.token_ids == ref.token_ids and a.num_computed_prompt_tokens == len(PROMPT)  # prefilled once
    # the channel is still in step: the same package, clean, goes through and decodes on B
    thread, got = receiving(b, end_b)
    send_handoff(end_a, handoff, chunk_bytes=CHUNK)
    thread.join(timeout=30)
    assert "error" not in got
    assert finish(b, rid)[0].token_ids == ref.token_ids


def test_a_receiver_that_refuses_the_import_sends_the_request_back(tiny_model):
    """Catches: a receiver that raises without answering (the sender would wait for the ack until
    the channel times out) and a sender that treats a refusal as delivered (the request is lost)."""
    ref, a, b, rid, handoff, end_a, end_b, thread, got = lossless_pair(tiny_model, "drop")
    with pytest.raises(HandoffRefused, match="eagle_mode"):
        send_handoff(end_a, handoff, chunk_bytes=CHUNK)
    thread.join(timeout=30)
    assert isinstance(got["error"], HandoffError) and not b.requests
    delivery = hand_off_or_keep(a, handoff, lambda h: a.export_request("nothing here"))  # any failing send
    assert not delivery.delivered and delivery.kept.request_id == rid
    assert finish(a, rid)[0].token_ids == ref.token_ids


def test_a_stream_cut_mid_way_raises_on_both_ends_and_a_finishes_the_request(tiny_model):
    """The sender's end is closed (`PairChannel.close`: its sockets shut) after 3 chunks are posted.
    Catches: a receiver that hangs or returns a half-filled package (it must raise the typed error),
    a sender whose channel error escapes untyped or skips the fallback, a `close` that leaves the
    sockets open (the receiver would fail only at the timeout)."""
    ref = one_engine(tiny_model, 0, "lossless")
    a, b = engine_for(tiny_model, 0, "lossless"), engine_for(tiny_model, 0, "lossless")
    rid = prefill(a, PROMPT)
    handoff = a.export_request(rid)
    end_a, end_b = channel_pair(timeout_s=3.0)
    thread, got = receiving(b, end_b)

    def close_at(k: int) -> None:
        if k == 3:
            end_a.close()

    failures = []

    def send(h):
        try:
            return send_handoff(end_a, h, chunk_bytes=CHUNK, before_chunk=close_at)
        except Exception as exc:
            failures.append(type(exc))  # not exc: its frames would keep the closed group alive
            raise

    delivery = hand_off_or_keep(a, handoff, send)
    thread.join(timeout=30)
    assert not thread.is_alive() and isinstance(got.get("error"), HandoffStreamTruncated)
    # mid-stream, and at once: the closed end's sockets shut (a still-open group would time out instead)
    assert "chunk" in str(got["error"]) and "timed out" not in str(got["error"]).lower()
    assert failures == [HandoffStreamTruncated] and not delivery.delivered
    assert not b.requests
    b.cache.check_integrity()
    out, _ = finish(a, rid)
    assert out.token_ids == ref.token_ids and a.num_computed_prompt_tokens == len(PROMPT)
    assert torch.is_tensor(handoff.pages[0][0])  # the package itself was never consumed


def test_a_header_or_chunk_list_that_does_not_check_out_is_refused_before_anything_is_allocated(tiny_model):
    """Hand-made streams over the real channel: a header (sizes + JSON), and for a good header the
    chunk list B asks for after its answer. Catches: a receiver that skips a checksum, trusts sizes
    past their bounds, builds the meta from a wrong type, or sizes its buffers from a chunk list
    that does not add up to the rows it asked for; and a refusal that leaves the stream out of step
    (the next stream on the same channel is read)."""
    a = engine_for(tiny_model, 0, "lossless")
    meta = encode_meta(a.export_request(prefill(a, PROMPT)).meta)
    end_a, end_b = channel_pair()

    def blob(data: dict, checksum_delta: int = 0, size: int | None = None, extra: tuple[int, ...] = ()) -> None:
        raw = json.dumps(data).encode()
        digest = xxhash.xxh3_64_intdigest(raw) - 2**63 + checksum_delta
        end_a.isend(torch.tensor([size or len(raw), digest, *extra], dtype=torch.int64)).wait()
        if size is None:
            end_a.isend(torch.frombuffer(bytearray(raw), dtype=torch.uint8)).wait()

    def answer() -> list[int]:
        status = torch.zeros(2, dtype=torch.int64)
        end_a.irecv(status).wait()
        body = torch.empty(int(status[1]), dtype=status.dtype if int(status[0]) == 0 else torch.uint8)
        if body.numel():
            end_a.irecv(body).wait()
        return [int(status[0]), body.tolist() if int(status[0]) == 0 else body.numpy().tobytes().decode()]

    def stream(header: dict, chunks: dict | None = None, payload: int = 32, **kw) -> tuple[str, list]:
        got: dict = {}
        thread = threading.Thread(target=lambda: got.update(error=_raises(lambda: recv_handoff(end_b))))
        thread.start()
        blob(header, **({} if chunks else kw))
        said = answer()
        if chunks is not None:
            assert said == [0, [0]]  # B asks for every row (it holds nothing)
            blob(chunks, extra=(payload,), **kw)
        thread.join(timeout=30)
        assert isinstance(got["error"], HandoffStreamCorrupt), got
        return str(got["error"]), said

    good = {"meta": meta, "groups": [1], "sampler_state": False, "tensors": [["torch.float32", [2, 4]]]}
    chunk_list = {"chunk_bytes": 16, "checksums": ["0", "0"]}
    error, said = stream(good, size=2**40)  # the sender is told why, and the stream stays in step
    assert "out of bounds" in error and said[0] == 1 and "out of bounds" in said[1]
    error, said = stream(good, checksum_delta=1)
    assert "header failed its checksum" in error and said[0] == 1 and "checksum" in said[1]
    assert "num_computed_tokens" in stream({**good, "meta": {**meta, "num_computed_tokens": "9"}})[0]
    assert "does not decode" in stream({**good, "tensors": [["builtins.eval", [2, 4]]]})[0]
    assert "does not match its groups" in stream({**good, "groups": [2]})[0]
    assert "rows asked for are 32 bytes" in stream(good, chunk_list, payload=64)[0]  # 2 x 4 float32
    assert "2 checksums for 32 chunks" in stream(good, {**chunk_list, "chunk_bytes": 1})[0]
    assert "chunk list failed its checksum" in stream(good, chunk_list, checksum_delta=1)[0]


def _raises(fn) -> Exception | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc
    return None
