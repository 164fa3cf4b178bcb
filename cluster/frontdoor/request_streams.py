"""Serving one request on a front-door worker thread: route, stream the replica's outputs, fail over.

    attempt: place (route + optional transfer) -> stream the replica's merged `RequestOutput`s
      finished             done
      replica died /       purge it (stopped: never left running), try another replica; the
      unhealthy            caller never sees a token twice or a gap: a retry regenerates from
                           the start (greedy / seeded outputs are deterministic) and only tokens
                           past those already delivered go out (the others are checked equal)
      unseeded sampling    cannot resume after tokens went out: a retryable error (HTTP 503)

    with `cluster.pd` (prefill/decode disaggregation) an attempt has two legs: the prefill replica
    streams the first token and holds the request (`GenerateMsg.hand_off`); the front door has the
    controller hand it to a decode replica (`FrontDoor.hand_off`) and streams the rest from
    whichever replica holds it then (the decoder, or the prefill replica when the hand-off failed
    and it kept the request); the tokens counted across both legs, so none goes out twice
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import ray
from ray.exceptions import RayActorError

from cache_service.router import NoReplicaError
from cluster.frontdoor.membership import MemberReplica
from workers.engine.errors import ServerOverloadedError
from workers.engine.request import RequestOutput
from workers.engine_runner import RequestStream, StreamEnd
from workers.replica import ReplicaUnhealthyError
from workers.replica_messages import GenerateMsg


class ReplicaFailedError(ServerOverloadedError):
    """The replica serving a request died and the request cannot be resumed elsewhere; retryable
    (HTTP 503)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message, retry_after_s)


class StreamBrokenError(RuntimeError):
    """A replica's stream ended without a finished output."""


@dataclass
class Job:
    msg: GenerateMsg
    stream: RequestStream
    forced: str | None
    cancelled: bool = False
    replica_id: str | None = None  # the replica of the current attempt (its decode replica after a hand-off)
    served_by: str | None = None  # the replica that finished it
    prefilled_by: str | None = None  # with `cluster.pd`: the replica that prefilled it
    decoder: str | None = None  # with `cluster.pd`: the decode replica reserved for it (`decode_handoffs`)
    early_sent: int = 0  # prompt tokens whose pages went to the decoder while prefilling
    early_ref: object = None  # the controller's transfer of them, while in flight


class FrontDoor(Protocol):
    """What serving a request needs from its front door (`ClusterBackend`)."""

    max_attempts: int
    disaggregated: bool  # `cluster.pd`: prefill on one replica, decode on another

    def place(self, job: Job, exclude: tuple[str, ...]) -> str:
        """Route (and move pages if planned); the target, its in-flight count booked. Raises `NoReplicaError`."""

    def release(self, replica_id: str) -> None:
        """The attempt on `replica_id` is over (its in-flight count goes back)."""

    def purge(self, replica_id: str, reason: str) -> None:
        """`replica_id` failed: stop using it, and have the controller purge it."""

    def replica(self, replica_id: str) -> MemberReplica | None: ...

    def count_retry(self) -> None: ...

    def hand_off(self, job: Job, src: str) -> str:
        """Hand the request `src` holds after its first token to a decode replica; the replica that
        holds it now (its in-flight count booked unless it is `src`). Raises `StreamBrokenError`
        when `src` could not answer (the request is retried from the start)."""

    def reserve_decoder(self, job: Job) -> None:
        """With `cluster.pd`, as the prefill starts: the decode replica for `job` (`job.decoder`)."""

    def drop_decoder(self, job: Job) -> None:
        """The prefill leg ended without a hand-off: give `job.decoder` back."""

    def prefill_progress(self, job: Job, src: str, position: int) -> None:
        """`src` has computed `position` prompt tokens of `job`: send its decoder what is ready."""

    def finished(self, job: Job, output: RequestOutput) -> None:
        """Called before the final output goes out (the front door remembers the prompt as hot, and
        the replica's prefill speed)."""


def serve_request(door: FrontDoor, job: Job) -> None:
    delivered: list[int] = []
    failed: list[str] = []
    try:
        for _ in range(door.max_attempts):
            if job.cancelled:
                job.stream.put(StreamEnd())
                return
            try:
                target = door.place(job, tuple(failed))
            except NoReplicaError as exc:
                job.stream.put(StreamEnd(ServerOverloadedError(f"no replica can serve now: {exc}", 2.0)))
                return
            try:
                if stream_from(door, job, target, delivered):
                    return
            except (RayActorError, StreamBrokenError, ReplicaUnhealthyError) as exc:
                unhealthy = isinstance(exc, ReplicaUnhealthyError)
                broken = job.replica_id or target  # after a hand-off: the decode replica's leg failed
                door.purge(broken, f"unhealthy ({exc})" if unhealthy else f"died ({type(exc).__name__})")
                failed.append(broken)
                if delivered and job.msg.params.temperature > 0 and job.msg.params.seed is None:
                    job.stream.put(StreamEnd(ReplicaFailedError(
                        f"replica {target} died mid-stream; an unseeded sampled request cannot resume: retry")))
                    return
                door.count_retry()
            finally:
                door.release(target)
        job.stream.put(StreamEnd(ReplicaFailedError(f"no replica completed the request in "
                                                    f"{door.max_attempts} attempts")))
    except Exception as exc:  # noqa: BLE001 - whatever it is, the caller gets it, not a hang
        job.stream.put(StreamEnd(exc))


def stream_from(door: FrontDoor, job: Job, target: str, delivered: list[int]) -> bool:
    """Stream `target`'s outputs into the job's stream (with `cluster.pd`: its first token, then
    the decode replica's); True when the request finished."""
    rep = door.replica(target)
    job.replica_id = target
    if rep is None:  # found dead (by another request or a health check) since it was chosen
        raise StreamBrokenError(f"replica {target} is gone")
    msg = dataclasses.replace(job.msg, hand_off=True) if door.disaggregated else job.msg
    progress = None
    if msg.hand_off:
        door.reserve_decoder(job)
        progress = functools.partial(door.prefill_progress, job, target)
    try:
        done, produced = _relay(door, job, target, rep.actor.generate_stream.remote(msg), delivered, 0, progress)
    except BaseException:
        door.drop_decoder(job)
        raise
    if done or not msg.hand_off or job.cancelled:
        door.drop_decoder(job)
        return _ended(job, target, done)
    job.prefilled_by = target
    holder = door.hand_off(job, target)
    try:
        job.replica_id = holder
        rep = door.replica(holder)
        if rep is None:
            raise StreamBrokenError(f"replica {holder} is gone")
        done, _ = _relay(door, job, holder, rep.actor.resume_stream.remote(job.msg.request_id), delivered,
                         produced)
        return _ended(job, holder, done)
    finally:
        if holder != target:
            door.release(holder)


def _ended(job: Job, replica_id: str, done: bool) -> bool:
    if done:
        return True
    if job.cancelled:  # aborted (client gone): the replica ended the stream on purpose
        job.stream.put(StreamEnd())
        return True
    raise StreamBrokenError(f"replica {replica_id} ended the stream early")


def _relay(door: FrontDoor, job: Job, replica_id: str, refs, delivered: list[int],
           produced: int, progress: Callable[[int], None] | None = None) -> tuple[bool, int]:
    """Relay a replica's merged outputs (`refs`) into the job's stream, `produced` tokens of this
    attempt already out; (finished, tokens produced). Tokens the caller already has are checked
    equal and not sent again. `progress(position)`: told the prompt tokens computed after each
    prefill chunk (an output with no token)."""
    for ref in refs:
        delta: RequestOutput = ray.get(ref)
        new = delta.new_token_ids
        overlap = max(0, min(produced + len(new), len(delivered)) - produced)
        if tuple(delivered[produced: produced + overlap]) != tuple(new[:overlap]):
            raise RuntimeError(f"replica {replica_id} produced a different output after a retry")
        fresh = new[overlap:]
        produced += len(new)
        if not fresh and not delta.finished:
            if progress is not None and not new:  # a prefill chunk
                progress(delta.num_cached_tokens + delta.num_computed_prompt_tokens)
            continue  # a prefill chunk, or tokens the caller already has
        delivered.extend(fresh)
        logprobs = None if delta.logprobs is None else tuple(delta.logprobs[len(delta.logprobs) - len(fresh):])
        out = dataclasses.replace(delta, new_token_ids=tuple(fresh), token_ids=tuple(delivered), logprobs=logprobs)
        if out.finished:
            job.served_by = replica_id
            door.finished(job, out)
        job.stream.put(out)
        if out.finished:
            return True, produced
    return False, produced
