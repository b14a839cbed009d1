"""The chaos half of ``benchmarks/load.py --chaos``: hostile and careless requests mixed into
normal traffic (issue 12's defects), each with the answer a hardened server must give.

    tiny temperature (1e-40)        200 (greedy)          huge seed (2**64)          400
    n = 10**6                       400 (max_n)           5 MiB body                 413
    unknown / refused fields        400                   disconnect mid-stream      (nothing to read)
    another tenant's session id     404 on GET / DELETE; continuing it starts the intruder's own
                                    session (its prompt never holds the victim's tokens)

Meanwhile ``/health`` is polled: any 503 is an engine death.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

INTRUDER_KEY = "chaos-intruder-key"
NORMAL_KEY = "chaos-normal-key"


@dataclass
class ChaosStats:
    sent: dict[str, int] = field(default_factory=dict)
    unexpected: dict[str, int] = field(default_factory=dict)
    server_errors: int = 0          # 5xx answers to chaos requests
    transport_errors: int = 0       # no answer at all (connection reset, timeout)
    hijack_leaks: int = 0           # another tenant's session was visible or continued
    health_checks: int = 0
    engine_deaths: int = 0          # /health answered 503
    samples: list[str] = field(default_factory=list)
    intruder_ids: set[str] = field(default_factory=set)  # ids the intruder made its own sessions under

    def record(self, kind: str, status: int, expected: tuple[int, ...], detail: str = "") -> None:
        self.sent[kind] = self.sent.get(kind, 0) + 1
        if status >= 500:
            self.server_errors += 1
        if status not in expected:
            self.unexpected[kind] = self.unexpected.get(kind, 0) + 1
            if len(self.samples) < 8:
                self.samples.append(f"{kind}: HTTP {status} (expected {expected}) {detail[:160]}")

    def to_dict(self) -> dict[str, Any]:
        return {"sent": self.sent, "unexpected": self.unexpected, "server_errors": self.server_errors,
                "transport_errors": self.transport_errors,
                "hijack_leaks": self.hijack_leaks, "health_checks": self.health_checks,
                "engine_deaths": self.engine_deaths, "samples": self.samples}


def keys_file_text() -> str:
    return f"{NORMAL_KEY} normal\n{INTRUDER_KEY} intruder\n"


async def watch_health(url: str, deadline: float, stats: ChaosStats) -> None:
    async with httpx.AsyncClient(timeout=10) as c:
        while time.monotonic() < deadline:
            try:
                r = await c.get(url + "/health")
                stats.health_checks += 1
                if r.status_code == 503:
                    stats.engine_deaths += 1
            except httpx.HTTPError:
                stats.engine_deaths += 1
            await asyncio.sleep(0.5)


async def _post(c: httpx.AsyncClient, url: str, body: Any, **kw: Any) -> httpx.Response:
    return await c.post(url + "/v1/chat/completions", json=body, **kw)


async def chaos_loop(i: int, url: str, model: str, deadline: float, victims: list[str], stats: ChaosStats,
                     seed: int = 0) -> None:
    rng = random.Random(seed * 7919 + i)
    chat = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "chaos"}]}
    normal = {"Authorization": f"Bearer {NORMAL_KEY}"}
    intruder = {"Authorization": f"Bearer {INTRUDER_KEY}"}
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as c:
        while time.monotonic() < deadline:
            kind = rng.choice(("tiny_temperature", "huge_seed", "big_n", "big_body", "unknown_field",
                               "refused_field", "disconnect", "hijack"))
            try:
                await _one(kind, c, url, chat, normal, intruder, victims, stats, rng)
            except httpx.HTTPError as exc:
                stats.transport_errors += 1
                stats.record(kind, 0, (), f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(rng.uniform(0.05, 0.3))


async def _one(kind: str, c: httpx.AsyncClient, url: str, chat: dict[str, Any], normal: dict[str, str],
               intruder: dict[str, str], victims: list[str], stats: ChaosStats, rng: random.Random) -> None:
    if kind == "tiny_temperature":
        r = await _post(c, url, {**chat, "temperature": 1e-40}, headers=normal)
        stats.record(kind, r.status_code, (200, 429), r.text)
    elif kind == "huge_seed":
        r = await _post(c, url, {**chat, "seed": 2**64 + rng.randrange(1000)}, headers=normal)
        stats.record(kind, r.status_code, (400,), r.text)
    elif kind == "big_n":
        r = await _post(c, url, {**chat, "n": 10**6, "max_tokens": 1}, headers=normal)
        stats.record(kind, r.status_code, (400,), r.text)
    elif kind == "big_body":
        body = json.dumps({**chat, "messages": [{"role": "user", "content": "x" * (5 * 2**20)}]})
        r = await c.post(url + "/v1/chat/completions", content=body,
                         headers={**normal, "content-type": "application/json"})
        stats.record(kind, r.status_code, (413,), r.text)
    elif kind == "unknown_field":
        r = await _post(c, url, {**chat, "frobnicate": True}, headers=normal)
        stats.record(kind, r.status_code, (400,), r.text)
    elif kind == "refused_field":
        field_ = rng.choice(("functions", "parallel_tool_calls", "service_tier", "reasoning_effort"))
        r = await _post(c, url, {**chat, field_: "auto"}, headers=normal)
        stats.record(kind, r.status_code, (400,), r.text)
    elif kind == "disconnect":
        async with c.stream("POST", url + "/v1/chat/completions", headers=normal,
                            json={**chat, "max_tokens": 64, "stream": True, "ignore_eos": True}) as r:
            status = r.status_code
            async for _ in r.aiter_lines():
                break  # the client goes away after the first line
        stats.record(kind, status, (200, 429))
    elif kind == "hijack" and victims:
        sid = rng.choice(victims)
        own = sid in stats.intruder_ids  # then the intruder sees its own session of that name
        got = await c.get(url + f"/v1/sessions/{sid}", headers=intruder)
        stats.record("hijack_get", got.status_code, (200, 404) if own else (404,), got.text)
        if got.status_code == 200 and not own:
            stats.hijack_leaks += 1
        stats.intruder_ids.add(sid)
        r = await _post(c, url, {**chat, "session_id": sid, "return_token_ids": True}, headers=intruder)
        stats.record("hijack_continue", r.status_code, (200, 409, 429), r.text)
        if r.status_code == 200 and len(r.json().get("prompt_token_ids", [])) > 64:
            stats.hijack_leaks += 1  # the intruder's prompt grew beyond its own one message
        d = await c.delete(url + f"/v1/sessions/{sid}", headers=intruder)
        stats.record("hijack_delete", d.status_code, (200, 404), d.text)  # only ever the intruder's own
