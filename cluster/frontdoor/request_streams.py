"""Serving one request on a front-door worker thread: route, stream the replica's outputs, fail over.

    attempt: place (route + optional transfer) -> stream the replica's merged `RequestOutput`s
      finished             done
      replica died /       purge it (stopped: never left running), try another replica; the
      unhealthy            caller never sees a token twice or a gap: a retry regenerates from
                           the start (greedy / seeded outputs are deterministic) and only tokens
                           past those already delivered go out (the others are checked equal)
      unseeded sampling    cannot resume after tokens went out: a retryable error (HTTP 503)
"""

from __future__ import annotations

import dataclasses
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
    replica_id: str | None = None  # the replica of the current attempt
    served_by: str | None = None  # the replica that finished it


class FrontDoor(Protocol):
    """What serving a request needs from its front door (`ClusterBackend`)."""

    max_attempts: int

    def place(self, job: Job, exclude: tuple[str, ...]) -> str:
        """Route (and move pages if planned); the target, its in-flight count booked. Raises `NoReplicaError`."""

    def release(self, replica_id: str) -> None:
        """The attempt on `replica_id` is over (its in-flight count goes back)."""

    def purge(self, replica_id: str, reason: str) -> None:
        """`replica_id` failed: stop using it, and have the controller purge it."""

    def replica(self, replica_id: str) -> MemberReplica | None: ...

    def count_retry(self) -> None: ...

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
                door.purge(target, f"unhealthy ({exc})" if unhealthy else f"died ({type(exc).__name__})")
                failed.append(target)
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
    """Stream `target`'s outputs into the job's stream; True when the request finished."""
    rep = door.replica(target)
    if rep is None:  # found dead (by another request or a health check) since it was chosen
        raise StreamBrokenError(f"replica {target} is gone")
    job.replica_id = target
    produced = 0  # tokens this attempt has produced (a retry starts again from 0)
    for ref in rep.actor.generate_stream.remote(job.msg):
        delta: RequestOutput = ray.get(ref)
        new = delta.new_token_ids
        overlap = max(0, min(produced + len(new), len(delivered)) - produced)
        if tuple(delivered[produced: produced + overlap]) != tuple(new[:overlap]):
            raise RuntimeError(f"replica {target} produced a different output after a retry")
        fresh = new[overlap:]
        produced += len(new)
        if not fresh and not delta.finished:
            continue  # a prefill chunk, or tokens the caller already has
        delivered.extend(fresh)
        logprobs = None if delta.logprobs is None else tuple(delta.logprobs[len(delta.logprobs) - len(fresh):])
        out = dataclasses.replace(delta, new_token_ids=tuple(fresh), token_ids=tuple(delivered), logprobs=logprobs)
        if out.finished:
            job.served_by = target
            door.finished(job, out)
        job.stream.put(out)
        if out.finished:
            return True
    if job.cancelled:  # aborted (client gone): the replica ended the stream on purpose
        job.stream.put(StreamEnd())
        return True
    raise StreamBrokenError(f"replica {target} ended the stream early")
