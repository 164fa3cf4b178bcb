"""The chaos soak's traffic: greedy completions over HTTP from a few client threads, each request
scored against its cold output.

Prompts come in families sharing a long prefix (a system prompt), so requests hit, route by
prefix and move pages. A client sends each request to one of the front doors and, as a client
behind a load balancer would, retries on the other on a refused connection or a retryable status
(429, 502, 503, 504) with a short backoff, up to `MAX_ATTEMPTS`. Every request ends as one of:

    ok       status 200 with the cold output
    differ   status 200 with another output (a wrong answer: must never happen)
    error    a non-retryable status (500, 400...): lost
    lost     no attempt succeeded
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from urllib.parse import urlparse

MAX_ATTEMPTS = 8
MAX_TOKENS = 12
RETRYABLE = {429, 502, 503, 504}
NUM_FAMILIES, VARIANTS, PREFIX_LEN, TAIL_LEN = 4, 3, 256, 64


def make_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(NUM_FAMILIES):
        prefix = [rng.randrange(3, 500) for _ in range(PREFIX_LEN)]
        prompts += [prefix + [rng.randrange(3, 500) for _ in range(TAIL_LEN)] for _ in range(VARIANTS)]
    return prompts


def _body(model: str, prompt: list[int], salt: str | None = None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    return body


def post(url: str, body: dict, timeout_s: float = 120.0) -> tuple[int, str]:
    """(HTTP status, the first choice's text or the error body)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read().decode()
        if resp.status != 200:
            return resp.status, data[:300]
        return 200, json.loads(data)["choices"][0]["text"]
    finally:
        conn.close()


def cold_outputs(url: str, model: str, prompts: list[list[int]]) -> list[str]:
    """Each prompt once under a salt of its own (nothing hits): the outputs every request must match."""
    out = []
    for i, p in enumerate(prompts):
        status, text = post(url, _body(model, p, f"cold-{i}-{time.time_ns()}"))
        if status != 200:
            raise RuntimeError(f"cold reference {i}: HTTP {status}: {text}")
        out.append(text)
    return out


class Traffic:
    def __init__(self, urls: list[str], model: str, prompts: list[list[int]], cold: list[str],
                 cold_ids: list[list[int]], concurrency: int, seed: int) -> None:
        """`cold`: each prompt's cold text (HTTP); `cold_ids`: its cold token ids (requests made
        through a front door object directly)."""
        self.urls, self.model, self.prompts, self.cold, self.cold_ids = urls, model, prompts, cold, cold_ids
        self.concurrency, self.seed = concurrency, seed
        self.records: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._pick = random.Random(seed + 1)

    def rng_pick(self, n: int) -> int:
        return self._pick.randrange(n)

    def start(self) -> None:
        for k in range(self.concurrency):
            t = threading.Thread(target=self._client, args=(random.Random(self.seed * 1000 + k),), daemon=True,
                                 name=f"chaos-client-{k}")
            t.start()
            self._threads.append(t)

    def stop(self, timeout_s: float = 300.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=timeout_s)

    def _client(self, rng: random.Random) -> None:
        while not self._stop.is_set():
            i, first = rng.randrange(len(self.prompts)), rng.randrange(len(self.urls))
            self._record(self.request(i, first, rng))

    def request(self, i: int, first_door: int, rng: random.Random) -> dict:
        rec = {"t0": time.time(), "prompt": i, "attempts": 0, "status": "lost", "error": None, "door": None}
        for attempt in range(MAX_ATTEMPTS):
            door = (first_door + attempt) % len(self.urls)
            rec["attempts"], rec["door"] = attempt + 1, door
            try:
                status, text = post(self.urls[door], _body(self.model, self.prompts[i]))
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out
                status, text = 0, f"{type(exc).__name__}: {exc}"
            if status == 200:
                rec["status"], rec["error"] = ("ok" if text == self.cold[i] else "differ"), None
                break
            rec["error"] = f"{status}: {text[:200]}"
            if status and status not in RETRYABLE:
                rec["status"] = "error"
                break
            time.sleep(min(2.0, 0.25 * (attempt + 1)) * (0.5 + rng.random()))
        rec["t1"] = time.time()
        return rec

    def forced_moves(self, backend, count: int = 2) -> None:
        """`count` prompts served on their holder, then forced onto another replica (their pages
        move first); recorded like the traffic, scored against the cold text."""
        from workers.engine.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        for i in range(count):
            salt = f"moved-{i}-{time.time_ns()}"
            rec = {"t0": time.time(), "prompt": i, "attempts": 1, "status": "lost", "error": None, "door": "forced"}
            try:
                cold, holder = backend.generate(self.prompts[i], params, cache_salt=salt)
                other = next((r for r in backend.replica_ids if r != holder), holder)
                warm, _ = backend.generate(self.prompts[i], params, cache_salt=salt, replica_id=other)
                same = list(warm.token_ids) == list(cold.token_ids) == self.cold_ids[i]
                rec["status"] = "ok" if same else "differ"
            except Exception as exc:  # noqa: BLE001 - scored: a forced request must finish too
                rec["error"] = f"{type(exc).__name__}: {exc}"[:200]
            rec["t1"] = time.time()
            self._record(rec)

    def forced_on(self, backend, replica_id: str) -> None:
        """One request of the traffic's prompts served on `replica_id` under a fresh salt (so that it
        computes and publishes new blocks); scored against the prompt's cold tokens."""
        from workers.engine.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        i = self._pick.randrange(len(self.prompts))
        rec = {"t0": time.time(), "prompt": i, "attempts": 1, "status": "lost", "error": None, "door": "forced"}
        try:
            out, _ = backend.generate(self.prompts[i], params, cache_salt=f"forced-{time.time_ns()}",
                                      replica_id=replica_id)
            rec["status"] = "ok" if list(out.token_ids) == self.cold_ids[i] else "differ"
        except Exception as exc:  # noqa: BLE001 - scored
            rec["error"] = f"{type(exc).__name__}: {exc}"[:200]
        rec["t1"] = time.time()
        self._record(rec)

    def _record(self, rec: dict) -> None:
        with self._lock:
            self.records.append(rec)
