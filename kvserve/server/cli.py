"""``kvserve serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from kvserve.config import CacheConfig, EngineConfig, parse_size


def build_engine_config(model: str | None, config_file: str | None, *, dtype: str | None = None,
                        kv_cache_memory: str | None = None, max_model_len: int | None = None,
                        max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                        block_size: int | None = None, session_idle_timeout_s: float | None = None,
                        device: str | None = None, kv_cache_dtype: str | None = None,
                        max_session_tokens: int | None = None, session_overflow: str | None = None,
                        session_retention_s: float | None = None,
                        max_sessions_per_tenant: int | None = None, runner: str | None = None,
                        kv_host_memory: str | None = None, kv_disk_dir: str | None = None,
                        kv_disk_size: str | None = None, kv_remote: str | None = None,
                        session_demote_after_s: float | None = None, speculative: str | None = None,
                        num_speculative_tokens: int | None = None, draft_model: str | None = None,
                        attention_backend: str | None = None, kv_quality_budget: str | None = None,
                        kv_calibration: str | None = None,
                        tensor_parallel_size: int | None = None) -> EngineConfig:
    """The engine config from ``--config FILE`` (what ``kvserve plan --write-config`` writes) or
    defaults, with every flag given on the command line taking precedence."""
    from kvserve.config_file import read_config_file
    from kvserve.engine.llm import resolve_model_path

    if config_file is not None:
        cf = read_config_file(config_file)
        base = cf.engine
        if session_idle_timeout_s is None and cf.extras.session_idle_timeout_s is not None:
            session_idle_timeout_s = float(cf.extras.session_idle_timeout_s)
    else:
        base = EngineConfig(model=resolve_model_path(model), cache=CacheConfig(kv_cache_memory=parse_size("512MiB")))
    cache = base.cache
    cache_kw: dict[str, Any] = {}
    if kv_cache_memory is not None:
        cache_kw["kv_cache_memory"] = parse_size(kv_cache_memory)
    if block_size is not None:
        cache_kw["block_size"] = block_size
    if session_idle_timeout_s is not None:
        cache_kw["session_idle_timeout_s"] = session_idle_timeout_s
    for name, size in (("kv_host_memory", kv_host_memory), ("kv_disk_size", kv_disk_size)):
        if size is not None:
            cache_kw[name] = parse_size(size)
    for name, value in (("kv_cache_dtype", kv_cache_dtype), ("max_session_tokens", max_session_tokens),
                        ("kv_disk_dir", kv_disk_dir), ("kv_remote", kv_remote),
                        ("session_demote_after_s", session_demote_after_s),
                        ("session_overflow", session_overflow), ("session_retention_s", session_retention_s),
                        ("max_sessions_per_tenant", max_sessions_per_tenant),
                        ("kv_quality_budget", kv_quality_budget), ("kv_calibration", kv_calibration)):
        if value is not None:
            cache_kw[name] = value
    sched_kw: dict[str, Any] = {k: v for k, v in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs),
                                  ("max_num_batched_tokens", max_num_batched_tokens)) if v is not None}
    spec_kw = {k: v for k, v in (("method", speculative), ("num_speculative_tokens", num_speculative_tokens),
                                 ("draft_model", draft_model))
               if v is not None}
    if spec_kw:
        sched_kw["speculative"] = dataclasses.replace(base.scheduler.speculative, **spec_kw)
    top_kw: dict[str, Any] = {}
    if model is not None:
        top_kw["model"] = resolve_model_path(model)
    if dtype is not None:
        top_kw["dtype"] = dtype
    if device is not None:
        top_kw["device"] = device
    if runner is not None:
        top_kw["runner"] = runner
    if attention_backend is not None:
        top_kw["attention_backend"] = attention_backend
    if tensor_parallel_size is not None:
        top_kw["tensor_parallel_size"] = tensor_parallel_size
    return dataclasses.replace(base, cache=dataclasses.replace(cache, **cache_kw),
                               scheduler=dataclasses.replace(base.scheduler, **sched_kw), **top_kw)


def serve(
    model: Annotated[str | None, typer.Option("--model", help="Checkpoint folder (default: the embedded model).")] = None,
    config: Annotated[str | None, typer.Option("--config", help="Engine config JSON (kvserve plan --write-config).")] = None,
    host: Annotated[str, typer.Option("--host", help="Address to bind; 0.0.0.0 exposes the server.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port")] = 8000,
    api_key: Annotated[list[str] | None, typer.Option(
        "--api-key", help="Require 'Authorization: Bearer KEY' on /v1/*; repeat for several tenants "
                          "(a flag shows in ps: prefer --api-keys-file or KVSERVE_API_KEY).")] = None,
    api_keys_file: Annotated[str | None, typer.Option("--api-keys-file",
                                                      help="File of 'KEY TENANT' lines.")] = None,
    share_prefix_cache: Annotated[bool, typer.Option(
        "--share-prefix-cache-across-tenants",
        help="Let tenants hit each other's prefix cache (cached_tokens then reveals shared prompts).")] = False,
    served_model_name: Annotated[str | None, typer.Option("--served-model-name",
                                                          help="Model id clients send (default: the folder name).")] = None,
    max_waiting: Annotated[int, typer.Option("--max-waiting",
                                             help="429 when this many sequences wait (0: no limit).")] = 256,
    max_n: Annotated[int, typer.Option("--max-n", help="Most samples (n) one request may ask for.")] = 128,
    max_body_size: Annotated[str, typer.Option("--max-body-size", help="Largest request body (413 above).")] = "4MiB",
    tokenizer_workers: Annotated[int, typer.Option("--tokenizer-workers", help="Tokenizer threads.")] = 2,
    dtype: Annotated[str | None, typer.Option("--dtype", help="auto, bfloat16, float16, float32.")] = None,
    kv_cache_dtype: Annotated[str | None, typer.Option("--kv-cache-dtype",
                                                       help="KV codec: auto, bf16, fp8, int8, int4 ...")] = None,
    kv_quality_budget: Annotated[str | None, typer.Option(
        "--kv-quality-budget", help="With --kv-cache-dtype auto: pick each layer's K/V codec so the KL "
                                    "stays within this budget, e.g. kl=1e-3 ('default': kl=1e-3).")] = None,
    kv_calibration: Annotated[str | None, typer.Option(
        "--kv-calibration", help="A per-layer KV calibration file: read if it exists, else calibrated "
                                 "and written (docs/kv-quant.md).")] = None,
    kv_cache_memory: Annotated[str | None, typer.Option("--kv-cache-memory", help="KV pool size, e.g. 2GiB.")] = None,
    max_model_len: Annotated[int | None, typer.Option("--max-model-len")] = None,
    max_num_seqs: Annotated[int | None, typer.Option("--max-num-seqs")] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option("--max-num-batched-tokens")] = None,
    block_size: Annotated[int | None, typer.Option("--block-size")] = None,
    session_idle_timeout: Annotated[float | None, typer.Option("--session-idle-timeout",
                                                               help="Seconds before an idle session's KV is released.")] = None,
    session_retention: Annotated[float | None, typer.Option(
        "--session-retention", help="Seconds before an idle session's history is forgotten.")] = None,
    max_session_tokens: Annotated[int | None, typer.Option("--max-session-tokens",
                                                           help="Most tokens one session may hold.")] = None,
    max_sessions_per_tenant: Annotated[int | None, typer.Option(
        "--max-sessions-per-tenant", help="A new session past it forgets the tenant's least recent idle one.")] = None,
    session_overflow: Annotated[str | None, typer.Option(
        "--session-overflow", help="When a session outgrows its cap: error, drop_oldest or window.")] = None,
    device: Annotated[str | None, typer.Option("--device", help="auto, cpu, cuda[:N].")] = None,
    attention_backend: Annotated[str | None, typer.Option(
        "--attention-backend", help="auto (timed on this machine, cached), torch_sdpa or native.")] = None,
    runner: Annotated[str | None, typer.Option(
        "--runner", help="inline (this process) or process (the model and KV in a child process).")] = None,
    kv_host_memory: Annotated[str | None, typer.Option("--kv-host-memory", help="Host RAM KV tier, e.g. 8GiB.")] = None,
    kv_disk_dir: Annotated[str | None, typer.Option(
        "--kv-disk-dir", help="Disk KV tier and session records (survive a restart).")] = None,
    kv_disk_size: Annotated[str | None, typer.Option("--kv-disk-size", help="Disk tier size (default 50GiB).")] = None,
    kv_remote: Annotated[str | None, typer.Option("--kv-remote", help="Redis KV tier: redis://HOST:PORT/DB.")] = None,
    price_input: Annotated[float, typer.Option("--price-input", help="Price per million computed prompt tokens.")] = 0.0,
    price_cached_input: Annotated[float, typer.Option(
        "--price-cached-input", help="Price per million prompt tokens served from cache.")] = 0.0,
    price_output: Annotated[float, typer.Option("--price-output", help="Price per million generated tokens.")] = 0.0,
    price_cache_write: Annotated[float | None, typer.Option(
        "--price-cache-write", help="Price per million prompt tokens written to a pinned prefix "
                                    "(prompt caching; default: the input price).")] = None,
    session_demote_after: Annotated[float | None, typer.Option(
        "--session-demote-after", help="With KV tiers: an idle session's pool blocks go after S s (default 60).")] = None,
    replicas: Annotated[int, typer.Option(
        "--replicas", help="Engine replicas as Ray actors behind one front end (1: no Ray).")] = 1,
    ray_address: Annotated[str | None, typer.Option(
        "--ray-address", help="Join this Ray cluster (auto, or HOST:PORT) instead of starting a local one.")] = None,
    router: Annotated[str, typer.Option(
        "--router", help="With replicas: kv (exact, tier-aware), round_robin or session_hash.")] = "kv",
    prefill_replicas: Annotated[int, typer.Option(
        "--prefill-replicas", help="A prefill/decode split: replicas that compute prompts (with --decode-replicas).")] = 0,
    decode_replicas: Annotated[int, typer.Option(
        "--decode-replicas", help="A prefill/decode split: replicas that receive the prompt's KV and decode.")] = 0,
    pd_channel: Annotated[str, typer.Option(
        "--pd-channel", help="How KV blocks go between replicas (P/D split, a session leaving a busy replica): "
                             "direct (TCP, runner to runner) or object_store (Ray's).")] = "direct",
    replica_restarts: Annotated[int, typer.Option(
        "--replica-restarts", help="With replicas: times Ray restarts a dead replica (-1: always).")] = 0,
    tensor_parallel_size: Annotated[int | None, typer.Option(
        "--tensor-parallel-size", help="Split the model over T worker processes (heads, KV heads, MLP).")] = None,
    speculative: Annotated[str | None, typer.Option(
        "--speculative", help="Speculative decoding: ngram (drafts from the request's and session's own tokens) "
        "or draft (a small model proposes them: --draft-model).")] = None,
    num_speculative_tokens: Annotated[int | None, typer.Option(
        "--num-speculative-tokens", help="Most draft tokens verified per step (default 8).")] = None,
    draft_model: Annotated[str | None, typer.Option(
        "--draft-model", help="Draft model for --speculative draft: a checkpoint directory sharing the "
        "model's tokenizer.")] = None,
    retune_kernels: Annotated[bool, typer.Option(
        "--retune-kernels", help="Measure the GEMM paths again instead of using this machine's cached choice "
        "(also KVSERVE_RETUNE_KERNELS=1).")] = False,
    gemm_extra_memory: Annotated[str | None, typer.Option(
        "--gemm-extra-memory", help="Memory for second copies of weights the GEMM plan may keep (e.g. 1GiB; default 64MiB): on "
        "a CPU where the fastest path for one row and the one for many rows need different layouts, a copy "
        "for each can make decode faster (AMX CPUs no longer need one: the tiled kernel runs on AMX tiles "
        "over the loaded weight) (also KVSERVE_GEMM_EXTRA_MIB).")] = None,
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
) -> None:
    """Serve the OpenAI API (completions, chat, sessions), /metrics and a live /dashboard."""
    import uvicorn

    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.engine.engine import LLMEngine
    from kvserve.engine.gc_heap import freeze_startup_heap
    from kvserve.pricing import Prices
    from kvserve.server.api import create_app
    from kvserve.server.config import ServerConfig
    from kvserve.server.tenants import collect_keys

    logging.basicConfig(level=log_level.upper(), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    if retune_kernels:
        os.environ["KVSERVE_RETUNE_KERNELS"] = "1"  # read by the loader, here or in a runner process
    if gemm_extra_memory is not None:
        from kvserve.model.gemm_plan import set_extra_budget

        set_extra_budget(gemm_extra_memory)
    keys = collect_keys(api_key or [], api_keys_file, os.environ.get("KVSERVE_API_KEY") or None)
    ecfg = build_engine_config(model, config, dtype=dtype, kv_cache_memory=kv_cache_memory,
                               max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                               session_idle_timeout_s=session_idle_timeout, device=device,
                               kv_cache_dtype=kv_cache_dtype, max_session_tokens=max_session_tokens,
                               session_overflow=session_overflow, session_retention_s=session_retention,
                               max_sessions_per_tenant=max_sessions_per_tenant, runner=runner,
                               kv_host_memory=kv_host_memory, kv_disk_dir=kv_disk_dir, kv_disk_size=kv_disk_size,
                               kv_remote=kv_remote, session_demote_after_s=session_demote_after,
                               speculative=speculative, num_speculative_tokens=num_speculative_tokens, draft_model=draft_model,
                               attention_backend=attention_backend,
                               kv_quality_budget=kv_quality_budget, kv_calibration=kv_calibration,
                               tensor_parallel_size=tensor_parallel_size)
    scfg = ServerConfig(host=host, port=port, api_keys=keys, share_prefix_cache_across_tenants=share_prefix_cache,
                        served_model_name=served_model_name or Path(ecfg.model).name,
                        max_waiting=max_waiting or None, max_n=max_n, max_body_bytes=parse_size(max_body_size),
                        tokenizer_workers=tokenizer_workers,
                        prices=Prices(price_input, price_cached_input, price_output, price_cache_write))
    if prefill_replicas or decode_replicas:
        replicas = prefill_replicas + decode_replicas
    if (replicas > 1 or ray_address is not None) and ecfg.tensor_parallel_size > 1:
        raise ValueError("--tensor-parallel-size > 1 with --replicas (Ray) is not supported yet")
    if replicas > 1 or ray_address is not None:
        from kvserve.cluster.launch import ClusterConfig, launch_replica_set
        from kvserve.cluster.router import RouterConfig

        engine: Any = launch_replica_set(ecfg, ClusterConfig(replicas=replicas, address=ray_address,
                                                             max_restarts=replica_restarts,
                                                             prefill_replicas=prefill_replicas,
                                                             pd_channel=pd_channel),
                                         RouterConfig(policy=router))
        typer.echo(f"kvserve: {replicas} replica(s) on Ray, router {router!r}", err=True)
    else:
        engine = AsyncLLMEngine(LLMEngine(ecfg))
    app = create_app(engine, scfg, model_path=ecfg.model)
    tenants = sorted(set(keys.values()))
    who = (f"{len(keys)} API key(s), {len(tenants)} tenant(s); each sees only its own sessions"
           + ("; prefix cache shared across tenants" if share_prefix_cache else "")) if keys else \
        "no API key: single-tenant, /v1/* is open to anyone who can reach this address"
    typer.echo(f"kvserve: serving {scfg.served_model_name!r} on http://{host}:{port} "
               f"(dashboard: http://{host}:{port}/dashboard) — {who}", err=True)
    frozen = freeze_startup_heap()  # no full collection walks the engine's objects again (gc_heap)
    logging.getLogger("kvserve.server").info("froze %d start-up objects out of the garbage collector's walks", frozen)
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower(), timeout_graceful_shutdown=5)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


if __name__ == "__main__":  # pragma: no cover - `python -m kvserve.server.cli`
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    typer.run(serve)
