"""The front end's record of served requests' prefix-cache lookups: the miss counter and
`GET /v1/cache/explain/{request_id}`.

    submitted(request_id, response_id, prompt, salt)   on accept: the OpenAI response id it answers
                                                       under, and whether an earlier request began
                                                       with the same grid unit under another salt
    record(request_id, report)                         the engine's `LookupReport` (on the request's
                                                       outputs): a short hit counts in
                                                       hybridserve_prefix_cache_misses{reason}
    explain(id)                                        `explain`'s JSON for it, by response id or
                                                       internal request id (`cache_service.ids`)

Memory is bounded: the last `capacity` requests accepted (each entry O(groups)); older ones are
forgotten (explain: 404). The counter's reasons are `cache_service.miss_reasons.MissReason`,
every label exported from 0. Runs on the server's event loop: no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass

from prometheus_client import CollectorRegistry, Counter

from cache_service.cacheability import CacheProfile
from cache_service.explain import explain_lookup
from cache_service.miss_reasons import LookupReport, MissReason, SaltedPrefixes, salt_miss

DEFAULT_CAPACITY = 1024


@dataclass
class ServedLookup:
    response_id: str | None
    salt_hid_prefix: bool  # an earlier request began with this prompt's first grid unit under another salt
    report: LookupReport | None = None


class CacheReports:
    def __init__(self, registry: CollectorRegistry, profile: CacheProfile | None,
                 capacity: int = DEFAULT_CAPACITY) -> None:
        self.misses = Counter(
            "hybridserve_prefix_cache_misses", "requests whose prefix-cache hit was short (zero, or below what "
            "the cache held of the prompt) by reason: " + ", ".join(r.value for r in MissReason), ["reason"],
            registry=registry)
        for reason in MissReason:  # every series exists from the start (rate() over a fresh server)
            self.misses.labels(reason.value)
        self.profile = profile
        self.capacity = capacity
        caching = profile is not None and profile.prefix_caching
        self._salts = SaltedPrefixes(profile.alignment, max(capacity, 1024)) if caching else None
        self._served: OrderedDict[str, ServedLookup] = OrderedDict()  # request id -> lookup, oldest first
        self._request_ids: dict[str, str] = {}  # response id -> request id

    def submitted(self, request_id: str, response_id: str | None, prompt: list[int], cache_salt: str | None) -> None:
        hid = self._salts.observe(prompt, cache_salt) if self._salts is not None else False
        if not self.capacity:
            return
        self._served[request_id] = ServedLookup(response_id, hid)
        if response_id is not None:
            self._request_ids[response_id] = request_id
        while len(self._served) > self.capacity:
            _, old = self._served.popitem(last=False)
            if old.response_id is not None:
                self._request_ids.pop(old.response_id, None)

    def record(self, request_id: str, report: LookupReport) -> None:
        """A lookup of `request_id` (once per distinct report: a retry elsewhere reports again)."""
        served = self._served.get(request_id)
        if served is not None and served.salt_hid_prefix and self.profile is not None:
            report = salt_miss(report, self.profile.alignment)
        if report.reason is not None:
            self.misses.labels(report.reason).inc()
        if served is not None:
            served.report = report

    def explain(self, request_id: str) -> dict | None:
        """`explain`'s JSON for a served request (None: unknown, forgotten, or not looked up yet)."""
        rid = self._request_ids.get(request_id, request_id)
        served = self._served.get(rid)
        if served is None or served.report is None:
            return None
        body = {"id": served.response_id, "request_id": rid}
        if self.profile is None:  # a backend that does not describe its cache: the report alone
            return {**body, **asdict(served.report)}
        return {**body, **explain_lookup(self.profile, served.report)}
