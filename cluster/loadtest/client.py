"""Drives a server with a `Workload` over HTTP: streaming `/v1/completions`, bounded concurrency.

TTFT is the time from sending the request to the first SSE chunk that carries a token; the
inter-token latencies (`itl_s`) are the gaps between later token deliveries. A request
never raises: HTTP errors, transport errors and broken streams become a `RequestRecord` whose
`status` says what happened (`"200"`, `"503"`, `"timeout"`, `"connect_error"`, ...). Only an
unreachable server at the start raises `ServerUnreachableError`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx

from cluster.loadtest.progress import Progress
from cluster.loadtest.prometheus import scrape_metrics
from cluster.loadtest.records import LoadTestResult, RequestRecord
from cluster.loadtest.workloads import RequestSpec, Workload, WorkloadConfig, build_workload

# token chunks closer than this came in one delivery (the server merges a stream's outputs when its
# reader lags and writes them as back-to-back SSE events): one inter-token gap, not several zeros
SAME_DELIVERY_S = 0.001


class ServerUnreachableError(RuntimeError):
    pass


def check_server(url: str, api_key: str | None = None, timeout_s: float = 5.0) -> None:
    """Raises `ServerUnreachableError` unless GET /health answers 200."""
    try:
        r = httpx.get(f"{url}/health", timeout=timeout_s, headers=_headers(api_key))
    except httpx.TransportError as exc:
        raise ServerUnreachableError(f"no server at {url}: {type(exc).__name__}: {exc or 'connection failed'}; "
                                     "start one with `hybridserve serve` or omit --url to spawn one") from None
    if r.status_code != 200:
        raise ServerUnreachableError(f"{url}/health answered {r.status_code}: {r.text[:200]}")


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _record_for(spec: RequestSpec, num_prompt_tokens: int) -> RequestRecord:
    return RequestRecord(spec.index, spec.source, spec.phase, spec.group, spec.turn, num_prompt_tokens,
                         spec.max_tokens, spec.cache_salt)


async def _send(client: httpx.AsyncClient, body: dict, rec: RequestRecord, t_run: float) -> None:
    t0 = time.perf_counter()
    rec.start_s = t0 - t_run
    last_token_t: float | None = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                rec.status, rec.error = str(r.status_code), text[:300]
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # the server failed mid-stream and said why
                    error = chunk["error"]
                    rec.status = "stream_error"
                    rec.error = str(error.get("message", error) if isinstance(error, dict) else error)[:300]
                    return
                for choice in chunk["choices"]:  # none in the final usage chunk
                    tokens = choice.get("token_ids") or []
                    now = time.perf_counter()
                    if rec.ttft_s is None and (tokens or choice.get("finish_reason")):
                        rec.ttft_s = now - t0
                    if tokens:
                        if last_token_t is not None and now - last_token_t >= SAME_DELIVERY_S:
                            rec.itl_s.append(now - last_token_t)
                        last_token_t = now
                    rec.output_token_ids += tokens
                usage = chunk.get("usage")
                if usage:
                    rec.completion_tokens = usage.get("completion_tokens")
                    rec.usage_prompt_tokens = usage.get("prompt_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = details.get("cached_tokens")
                    rec.computed_tokens = details.get("computed_tokens")
        rec.latency_s = time.perf_counter() - t0
        if rec.completion_tokens is None:
            rec.status, rec.error = "stream_error", "stream ended without a usage chunk"
        else:
            rec.status = "200"
    except httpx.TimeoutException as exc:
        rec.status, rec.error = "timeout", f"{type(exc).__name__}: {exc}"
    except httpx.ConnectError as exc:
        rec.status, rec.error = "connect_error", str(exc)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError) as exc:
        rec.status, rec.error = "stream_error", f"{type(exc).__name__}: {exc}"


async def _run_specs(url: str, workload: Workload, config: WorkloadConfig, api_key: str | None,
                     progress: Progress) -> list[RequestRecord]:
    specs = workload.specs
    done = {s.index: asyncio.Event() for s in specs}
    records: dict[int, RequestRecord] = {}
    concurrency = max(config.concurrency, workload.min_concurrency)
    limit = asyncio.Semaphore(concurrency)
    t_run = time.perf_counter()
    timeout = httpx.Timeout(config.timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(base_url=url, headers=_headers(api_key), timeout=timeout, limits=limits) as client:

        async def one(spec: RequestSpec) -> None:
            for dep in spec.after:
                await done[dep].wait()
            broken = _broken_chain(spec, specs, records)
            prompt = list(spec.prompt) if broken is not None else _resolved_prompt(spec, specs, records)
            rec = records[spec.index] = _record_for(spec, len(prompt))
            if broken is not None:  # a chat turn cannot be built without the previous turn's response
                rec.status, rec.error = "skipped", f"extends failed request {broken}"
            else:
                if spec.arrival_s is not None:
                    await asyncio.sleep(max(0.0, t_run + spec.arrival_s - time.perf_counter()))
                if spec.delay_s:
                    await asyncio.sleep(spec.delay_s)
                body = {"prompt": prompt, "max_tokens": spec.max_tokens, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}, "ignore_eos": True}
                if spec.cache_salt:
                    body["cache_salt"] = spec.cache_salt
                async with limit:
                    await _send(client, body, rec, t_run)
            progress.update(rec.ok)
            done[spec.index].set()

        await asyncio.gather(*(one(s) for s in specs))
    return [records[s.index] for s in specs]


def _broken_chain(spec: RequestSpec, specs: tuple[RequestSpec, ...], records: dict[int, RequestRecord]) -> int | None:
    """The first request up `spec`'s `extends` chain that did not succeed, if any."""
    cur = spec.extends
    while cur is not None:
        if not records[cur].ok:
            return cur
        cur = specs[cur].extends
    return None


def _resolved_prompt(spec: RequestSpec, specs: tuple[RequestSpec, ...], records: dict[int, RequestRecord]) -> list[int]:
    """A chat turn: the previous turn's full prompt + its response + this turn's message."""
    chain: list[RequestSpec] = []
    cur: RequestSpec | None = spec
    while cur is not None:
        chain.append(cur)
        cur = specs[cur.extends] if cur.extends is not None else None
    prompt: list[int] = []
    for s in reversed(chain):
        prompt += list(s.prompt)
        if s is not spec:
            prompt += records[s.index].output_token_ids
    return prompt


def run_workload(url: str, config: WorkloadConfig, *, api_key: str | None = None, variant: str = "server",
                 show_progress: bool = True, workload: Workload | None = None) -> LoadTestResult:
    """Runs `config`'s workload (or a prebuilt `workload`, with `config`'s concurrency and timeout)
    against the server at `url`, e.g. http://127.0.0.1:8000."""
    url = url.rstrip("/")
    check_server(url, api_key)
    if config.salt is None:
        config = config.replace(salt=f"{uuid.uuid4().hex[:8]}-{config.workload}-")
    workload = workload or build_workload(config)
    before = scrape_metrics(url)
    progress = Progress(f"{variant}/{workload.name}", workload.num_requests, enabled=show_progress)
    t0 = time.perf_counter()
    records = asyncio.run(_run_specs(url, workload, config, api_key, progress))
    wall_s = time.perf_counter() - t0
    progress.close()
    after = scrape_metrics(url)
    delta = after - before if before is not None and after is not None else None
    return LoadTestResult(workload.name, variant, config, records, wall_s, delta)
