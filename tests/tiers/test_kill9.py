"""kill -9 through the real server: a session of 5 chat turns, ``kill -9`` of the ``kvserve serve``
process, a restart on the same ``--kv-disk-dir``; the session is listed, and turn 6 (only the new
message sent) answers with the tokens of a server that never crashed, its history's KV loaded
from disk (``cached_tokens`` ≥ 95% of the history). TTFT of the restored turn is measured against
the warm one and printed (no timing assertion)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.engine.conftest import write_tiny_llama

QUESTIONS = [f"question number {i}: tell me about topic {i * 7}" for i in range(6)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, model: Path, disk: Path | None) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(model), "--port", str(self.port),
               "--dtype", "float32", "--kv-cache-memory", "4MiB", "--block-size", "4", "--log-level", "warning"]
        if disk is not None:
            cmd += ["--kv-disk-dir", str(disk)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"kvserve serve did not start: {err[-2000:]}")
            time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def turn(self, question: str) -> tuple[dict, float]:  # type: ignore[type-arg]
        body = {"model": "m", "messages": [{"role": "user", "content": question}], "session_id": "conv",
                "max_tokens": 8, "temperature": 0}
        t0 = time.perf_counter()
        r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json(), time.perf_counter() - t0

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("kill9") / "m")


def test_a_session_survives_kill_9(model: Path, tmp_path: Path) -> None:
    calm = Server(model, None)
    try:
        expected = [calm.turn(q)[0] for q in QUESTIONS]
        warm_ttft = calm.turn("one more")[1]
    finally:
        calm.stop()
    srv = Server(model, tmp_path)
    try:
        for q, want in zip(QUESTIONS[:5], expected):
            got, _ = srv.turn(q)
            assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        srv.kill9()
    finally:
        srv.stop()
    again = Server(model, tmp_path)
    try:
        listed = httpx.get(again.url + "/v1/sessions", timeout=30).json()
        assert [s["id"] for s in listed["data"]] == ["conv"]
        got, ttft = again.turn(QUESTIONS[5])
    finally:
        again.stop()
    want = expected[5]
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    usage = got["usage"]
    history = want["usage"]["prompt_tokens_details"]["cached_tokens"]  # what the uncrashed server reused
    assert usage["prompt_tokens"] == want["usage"]["prompt_tokens"] and history > 0
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.95 * history
    assert usage["kv"]["hit_tokens"]["disk"] == usage["prompt_tokens_details"]["cached_tokens"]
    print(f"\nrestored turn 6: TTFT {ttft * 1e3:.0f} ms (whole request) vs a warm turn {warm_ttft * 1e3:.0f} ms; "
          f"history {history} tokens, {usage['prompt_tokens_details']['cached_tokens']} cached from disk")
