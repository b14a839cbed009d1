"""A real uvicorn server on 127.0.0.1 (free port, background thread) over a tiny random-weight
Llama with the shipped tokenizer and chat template."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.engine import LLMEngine
from kvserve.server.api import create_app
from kvserve.server.config import ServerConfig
from tests.engine.conftest import write_tiny_llama

MODEL_NAME = "tiny"
BLOCK_SIZE = 4


@dataclass
class LiveServer:
    url: str
    engine: AsyncLLMEngine
    server: uvicorn.Server
    thread: threading.Thread
    config: ServerConfig

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of ``/metrics`` keyed by (name, sorted labels other than model_name)."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, labels)] = s.value
        return out

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def engine_config(model_dir: Path, **sched: Any) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="float32", device="cpu", seed=0,
                        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks_override=256),
                        scheduler=SchedulerConfig(max_model_len=sched.pop("max_model_len", 256), **sched))


def start_server(model_dir: Path, engine_cfg: EngineConfig | None = None, engine: Any = None,
                 **server_kw: Any) -> LiveServer:
    """``engine``: an AsyncLLMEngine-like object to serve (a replica set) instead of a new one."""
    engine = engine or AsyncLLMEngine(LLMEngine(engine_cfg or engine_config(model_dir)), idle_tick_s=0.2)
    cfg = ServerConfig(served_model_name=MODEL_NAME, sample_interval_s=0.25, **server_kw)
    app = create_app(engine, cfg, model_path=str(model_dir))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", engine, server, thread, cfg)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("server-tiny-llama"))


@pytest.fixture(scope="session")
def live(tiny_model: Path) -> Iterator[LiveServer]:
    """The shared server: no API key, no queue limit that tests could hit."""
    srv = start_server(tiny_model, max_waiting=None)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def strict(tiny_model: Path) -> Iterator[LiveServer]:
    """API key required; one running request at a time and at most one waiting."""
    cfg = engine_config(tiny_model, max_num_seqs=1, max_model_len=512)
    srv = start_server(tiny_model, cfg, api_key="sekret", max_waiting=1)
    yield srv
    srv.stop()


@pytest.fixture()
def client(live: LiveServer):  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=60)


def wait_until(cond: Any, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def held_blocks(live: LiveServer) -> int:
    """Blocks held by requests (used minus pinned by sessions), read on the engine thread."""
    st = live.engine.call_blocking(lambda e: e.stats())
    return st.blocks_used - st.blocks_pinned
