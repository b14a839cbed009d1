"""Load test for ``kvserve serve``: N concurrent streaming clients for a fixed time.

    python benchmarks/load.py                                  # 32 clients, 120 s, embedded model
    python benchmarks/load.py --duration 20 --out load.json    # a short run
    python benchmarks/load.py --url http://127.0.0.1:8000      # an already running server

Without ``--url`` it starts ``kvserve serve`` as a subprocess on a free port (its own process, so
the RSS figures are the server's) and stops it at the end. Each client loops: a streaming chat
request, read to ``[DONE]``, next. ``--session-clients`` of them hold a multi-turn session (new
messages only, ``session_id``), closing and restarting it before it outgrows the context.

Reports requests/s, output tokens/s, TTFT / inter-token latency / end-to-end percentiles, errors
(target: none), KV blocks still held after the run once sessions are closed (target: none) and
the server's RSS at start and end (from ``/metrics``). Prints a table and writes JSON.

``--chaos`` runs twice on one server (two tenants, from an API-keys file): first the normal
clients alone, then the same clients with ``--chaos-clients`` hostile ones beside them
(benchmarks/chaos.py: tiny temperatures, huge seeds, big n, big bodies, refused and unknown
fields, disconnects, session hijack attempts). It reports engine deaths, 5xx, chaos answers that
were not the expected ones, normal requests answered, normal p99 latency with chaos ÷ without,
blocks back to 0 and RSS growth, and exits 1 if any target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos import NORMAL_KEY, ChaosStats, chaos_loop, keys_file_text, watch_health

WORDS = ("cache", "block", "token", "memory", "page", "prefix", "session", "queue", "batch", "stream",
         "latency", "model", "layer", "head", "vector", "python", "server", "request", "reply", "answer",
         "question", "river", "mountain", "garden", "window", "story")


@dataclass
class Result:
    ok: bool
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(-(-q * len(s) // 100)) - 1))]


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` as name → value (labels dropped; the server has one model)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if not s.labels.get("finish_reason") and not s.labels.get("le")}


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[Result, dict | None]:
    t0 = time.perf_counter()
    res, last, usage = Result(ok=False), None, None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                res.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return res, None
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res, None
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for ch in chunk.get("choices", []):
                    n = len(ch.get("token_ids") or [])
                    if not n:
                        continue
                    now = time.perf_counter()
                    if res.ttft_s is None:
                        res.ttft_s = now - t0
                        n -= 1
                    elif last is not None:
                        res.itls_s.extend([(now - last) / n] * n)
                    last = now
                    res.output_tokens += len(ch["token_ids"])
            res.ok = done and usage is not None
            res.error = None if res.ok else "stream ended without [DONE] and usage"
    except Exception as exc:  # noqa: BLE001 - every failure is a counted error
        res.error = f"{type(exc).__name__}: {exc}"
    res.e2e_s = time.perf_counter() - t0
    return res, usage


async def client_loop(i: int, url: str, model: str, args: argparse.Namespace, deadline: float,
                      max_model_len: int, results: list[Result], victims: list[str] | None = None) -> None:
    rng = random.Random(args.seed * 1000 + i)
    use_session = i < args.session_clients
    sid, session_tokens, turn = f"load-{i}-0", 0, 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), headers=_auth(args)) as client:
        while time.monotonic() < deadline:
            words = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
            body: dict[str, Any] = {
                "model": model, "messages": [{"role": "user", "content": words}], "stream": True,
                "stream_options": {"include_usage": True}, "max_tokens": args.max_tokens,
                "temperature": 0.8, "seed": rng.randrange(1 << 30), "return_token_ids": True,
            }
            if use_session:
                if session_tokens + 3 * args.prompt_words + 2 * args.max_tokens > max_model_len:
                    await client.delete(f"{url}/v1/sessions/{sid}")
                    turn += 1
                    sid, session_tokens = f"load-{i}-{turn}", 0
                body["session_id"] = sid
                if victims is not None and sid not in victims:
                    victims.append(sid)
            res, usage = await one_request(client, url, body)
            results.append(res)
            if use_session and usage:
                session_tokens = usage["total_tokens"]
        if use_session:
            await client.delete(f"{url}/v1/sessions/{sid}")


def _auth(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), "--log-level", "warning",
           "--max-waiting", "0", "--kv-cache-memory", args.kv_cache_memory]
    for flag, value in (("--model", args.model), ("--config", args.config), ("--max-num-seqs", args.max_num_seqs)):
        if value is not None:
            cmd += [flag, str(value)]
    if args.chaos:
        keys = Path(args.server_log).with_suffix(".keys")
        keys.write_text(keys_file_text())
        keys.chmod(0o600)
        cmd += ["--api-keys-file", str(keys)]
    log = open(args.server_log, "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {args.server_log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not become healthy within 300 s")


def screenshot(url: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    profile = Path("/tmp") / f"kvserve-load-chromium-{free_port()}"
    subprocess.run(["/usr/bin/chromium", "--headless", "--no-sandbox", "--disable-gpu",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    "--no-first-run", "--hide-scrollbars", f"--user-data-dir={profile}", "--window-size=1400,1250",
                    "--virtual-time-budget=3000", f"--screenshot={out}", url + "/dashboard"],
                   capture_output=True, timeout=120, check=False)


async def run(args: argparse.Namespace, url: str, chaos: bool = False) -> dict[str, Any]:
    headers = _auth(args)
    async with httpx.AsyncClient(headers=headers, timeout=30) as c:
        models = (await c.get(url + "/v1/models")).json()["data"][0]
    model, max_model_len = models["id"], int(models["max_model_len"])
    start = await asyncio.to_thread(scrape, url)
    results: list[Result] = []
    t0 = time.monotonic()
    deadline = t0 + args.duration
    shot: threading.Timer | None = None
    if args.screenshot:
        shot = threading.Timer(args.duration * 0.8, screenshot, (url, Path(args.screenshot)))
        shot.start()
    stats, victims = ChaosStats(), []  # type: ignore[var-annotated]
    extra = [watch_health(url, deadline, stats)]
    if chaos:
        extra += [chaos_loop(i, url, model, deadline, victims, stats, args.seed) for i in range(args.chaos_clients)]
    await asyncio.gather(*(client_loop(i, url, model, args, deadline, max_model_len, results, victims)
                           for i in range(args.clients)), *extra)
    wall = time.monotonic() - t0
    if shot is not None:
        await asyncio.to_thread(shot.join)
    await asyncio.sleep(0.5)  # let the last aborts/closes land
    end = await asyncio.to_thread(scrape, url)
    ok = [r for r in results if r.ok]
    itls = [g for r in ok for g in r.itls_s]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2es = [r.e2e_s for r in ok]
    errors = [r.error for r in results if not r.ok]
    return {
        "config": {k: v for k, v in vars(args).items() if k != "api_key"},
        "url": url, "model": model, "wall_s": wall,
        "requests": len(results), "requests_ok": len(ok), "errors": len(errors), "error_samples": errors[:5],
        "requests_per_s": len(ok) / wall, "output_tokens_per_s": sum(r.output_tokens for r in ok) / wall,
        "ttft_s": {f"p{q}": pct(ttfts, q) for q in (50, 90, 99)},
        "itl_s": {f"p{q}": pct(itls, q) for q in (50, 90, 99)},
        "e2e_s": {f"p{q}": pct(e2es, q) for q in (50, 90, 99)},
        # nothing runs and our sessions are closed: any block still used by no session is leaked
        "blocks_leaked": int(end.get("kvserve:kv_blocks_used", 0) - end.get("kvserve:kv_blocks_pinned", 0)),
        "blocks_pinned_after": int(end.get("kvserve:kv_blocks_pinned", 0)),
        "requests_left": int(end.get("kvserve:num_requests_running", 0) + end.get("kvserve:num_requests_waiting", 0)),
        "sessions_left": int(end.get("kvserve:sessions_active", 0)),
        "rss_start_bytes": int(start.get("process_resident_memory_bytes", 0)),
        "rss_end_bytes": int(end.get("process_resident_memory_bytes", 0)),
        "preemptions": int(end.get("kvserve:num_preemptions_total", 0) - start.get("kvserve:num_preemptions_total", 0)),
        "prefix_hit_rate": _ratio(end, start, "kvserve:prefix_cache_hits_total", "kvserve:prefix_cache_queries_total"),
        "chaos": stats.to_dict(),
    }


def _ratio(end: dict[str, float], start: dict[str, float], num: str, den: str) -> float | None:
    d = end.get(den, 0) - start.get(den, 0)
    return (end.get(num, 0) - start.get(num, 0)) / d if d else None


def print_table(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def ms(v: float | None) -> str:
        return "–" if v is None else f"{v * 1000:.1f}"

    t = Table(title=f"kvserve load: {r['config']['clients']} streaming clients, {r['wall_s']:.0f} s, {r['model']}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [("requests ok / errors", f"{r['requests_ok']} / {r['errors']}"),
            ("requests/s", f"{r['requests_per_s']:.2f}"), ("output tokens/s", f"{r['output_tokens_per_s']:.1f}")]
    for key, label in (("ttft_s", "TTFT"), ("itl_s", "inter-token latency"), ("e2e_s", "end-to-end")):
        rows.append((f"{label} p50 / p90 / p99 (ms)", " / ".join(ms(r[key][p]) for p in ("p50", "p90", "p99"))))
    rows += [("KV blocks held after the run (leaked)", str(r["blocks_leaked"])),
             ("requests / sessions left", f"{r['requests_left']} / {r['sessions_left']}"),
             ("preemptions", str(r["preemptions"])),
             ("prefix hit rate", "–" if r["prefix_hit_rate"] is None else f"{r['prefix_hit_rate']:.1%}"),
             ("server RSS start → end (MiB)", f"{r['rss_start_bytes'] / 2**20:.0f} → {r['rss_end_bytes'] / 2**20:.0f}")]
    for row in rows:
        t.add_row(*row)
    Console().print(t)
    for e in r["error_samples"]:
        print("error:", e)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="an already running server (default: start one)")
    p.add_argument("--model", help="checkpoint for the started server (default: the embedded model)")
    p.add_argument("--config", help="engine config file for the started server")
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--api-key")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--session-clients", type=int, default=8, help="clients that hold a multi-turn session")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="load.json", help="JSON results")
    p.add_argument("--screenshot", help="save a dashboard screenshot (headless chromium) here during the run")
    p.add_argument("--server-log", default="/tmp/kvserve-load-server.log")
    p.add_argument("--chaos", action="store_true", help="a baseline run, then the same with hostile clients")
    p.add_argument("--chaos-clients", type=int, default=4, help="hostile clients beside the normal ones")
    args = p.parse_args()
    if args.session_clients > args.clients:
        p.error("--session-clients cannot exceed --clients")
    if args.chaos and args.url is None:
        args.api_key = NORMAL_KEY
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    try:
        result = asyncio.run(run(args, url.rstrip("/")))
        if args.chaos:
            result = {"baseline": result, "chaos": asyncio.run(run(args, url.rstrip("/"), chaos=True))}
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    if args.chaos:
        result["summary"] = chaos_summary(result["baseline"], result["chaos"])
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for part in (("baseline", "chaos") if args.chaos else ()):
        print_table(result[part])
    if not args.chaos:
        print_table(result)
    else:
        print(json.dumps(result["summary"], indent=2))
    print(f"wrote {args.out}")
    runs = [result["baseline"], result["chaos"]] if args.chaos else [result]
    if any(r["errors"] or r["blocks_leaked"] or r["requests_left"] for r in runs) or \
            (args.chaos and not result["summary"]["pass"]):
        sys.exit(1)


def chaos_summary(base: dict[str, Any], chaos: dict[str, Any]) -> dict[str, Any]:
    c = chaos["chaos"]
    p99_base, p99_chaos = base["e2e_s"]["p99"], chaos["e2e_s"]["p99"]
    ratio = p99_chaos / p99_base if p99_base and p99_chaos else None
    out = {"engine_deaths": c["engine_deaths"] + base["chaos"]["engine_deaths"],
           "chaos_5xx": c["server_errors"], "chaos_no_answer": c["transport_errors"],
           "chaos_unexpected": sum(c["unexpected"].values()),
           "hijack_leaks": c["hijack_leaks"], "chaos_requests": sum(c["sent"].values()),
           "normal_answered": f"{chaos['requests_ok']} / {chaos['requests']}",
           "normal_errors": chaos["errors"], "normal_e2e_p99_s": {"baseline": p99_base, "chaos": p99_chaos},
           "p99_ratio": ratio, "blocks_leaked": chaos["blocks_leaked"],
           "rss_mib": {"start": base["rss_start_bytes"] / 2**20, "end": chaos["rss_end_bytes"] / 2**20}}
    out["pass"] = bool(out["engine_deaths"] == 0 and out["chaos_5xx"] == 0 and out["hijack_leaks"] == 0
                       and out["chaos_unexpected"] == 0
                       and chaos["errors"] == 0 and out["blocks_leaked"] == 0 and ratio is not None and ratio <= 2.0)
    return out


if __name__ == "__main__":
    main()
