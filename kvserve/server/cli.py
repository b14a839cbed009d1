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
                        device: str | None = None) -> EngineConfig:
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
    sched_kw: dict[str, Any] = {k: v for k, v in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs),
                                  ("max_num_batched_tokens", max_num_batched_tokens)) if v is not None}
    top_kw: dict[str, Any] = {}
    if model is not None:
        top_kw["model"] = resolve_model_path(model)
    if dtype is not None:
        top_kw["dtype"] = dtype
    if device is not None:
        top_kw["device"] = device
    return dataclasses.replace(base, cache=dataclasses.replace(cache, **cache_kw),
                               scheduler=dataclasses.replace(base.scheduler, **sched_kw), **top_kw)


def serve(
    model: Annotated[str | None, typer.Option("--model", help="Checkpoint folder (default: the embedded model).")] = None,
    config: Annotated[str | None, typer.Option("--config", help="Engine config JSON (kvserve plan --write-config).")] = None,
    host: Annotated[str, typer.Option("--host", help="Address to bind; 0.0.0.0 exposes the server.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port")] = 8000,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="KVSERVE_API_KEY",
                                                help="Require 'Authorization: Bearer KEY' on /v1/*.")] = None,
    served_model_name: Annotated[str | None, typer.Option("--served-model-name",
                                                          help="Model id clients send (default: the folder name).")] = None,
    max_waiting: Annotated[int, typer.Option("--max-waiting", help="429 when this many requests wait (0: no limit).")] = 256,
    dtype: Annotated[str | None, typer.Option("--dtype", help="auto, bfloat16, float16, float32.")] = None,
    kv_cache_memory: Annotated[str | None, typer.Option("--kv-cache-memory", help="KV pool size, e.g. 2GiB.")] = None,
    max_model_len: Annotated[int | None, typer.Option("--max-model-len")] = None,
    max_num_seqs: Annotated[int | None, typer.Option("--max-num-seqs")] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option("--max-num-batched-tokens")] = None,
    block_size: Annotated[int | None, typer.Option("--block-size")] = None,
    session_idle_timeout: Annotated[float | None, typer.Option("--session-idle-timeout",
                                                               help="Seconds before an idle session's KV is released.")] = None,
    device: Annotated[str | None, typer.Option("--device", help="auto, cpu, cuda[:N].")] = None,
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
) -> None:
    """Serve the OpenAI API (completions, chat, sessions), /metrics and a live /dashboard."""
    import uvicorn

    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.engine.engine import LLMEngine
    from kvserve.server.api import create_app
    from kvserve.server.config import ServerConfig

    logging.basicConfig(level=log_level.upper(), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    ecfg = build_engine_config(model, config, dtype=dtype, kv_cache_memory=kv_cache_memory,
                               max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                               session_idle_timeout_s=session_idle_timeout, device=device)
    scfg = ServerConfig(host=host, port=port, api_key=api_key or None,
                        served_model_name=served_model_name or Path(ecfg.model).name,
                        max_waiting=max_waiting or None)
    engine = AsyncLLMEngine(LLMEngine(ecfg))
    app = create_app(engine, scfg, model_path=ecfg.model)
    typer.echo(f"kvserve: serving {scfg.served_model_name!r} on http://{host}:{port} "
               f"(dashboard: http://{host}:{port}/dashboard){' — API key required' if api_key else ''}",
               err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower(), timeout_graceful_shutdown=5)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


if __name__ == "__main__":  # pragma: no cover - `python -m kvserve.server.cli`
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    typer.run(serve)
