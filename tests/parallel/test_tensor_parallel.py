"""``tensor_parallel_size=2``: two worker processes, each with half the heads, KV heads and MLP
columns, give the greedy tokens of one worker (fp32) with the shared-memory all-reduce and with
gloo's, hold the planner's per-GPU pool, and a dead worker is an error, not a hang; a size the
model cannot be split into is refused."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from kvserve import LLM, SamplingParams
from kvserve.cli import app
from kvserve.kv.press import PressSpec
from kvserve.native.choices import KernelChoice
from kvserve.parallel.shm_allreduce import ENV
from kvserve.runner.process_runner import RunnerProcessError
from tests.parallel.conftest import CASES, GREEDY, KW, PROMPTS, tokens


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_workers_give_the_tokens_of_one(models: dict[str, Path], name: str) -> None:
    one = tokens(LLM(str(models[name]), kv_cache_memory="2MiB", **KW))
    with LLM(str(models[name]), kv_cache_memory="1MiB", tensor_parallel_size=2, **KW) as llm:
        runner = llm.engine.runner
        assert len(set(runner.pids)) == 2 and os.getpid() not in runner.pids
        assert tokens(llm) == one
        assert [allreduce(c) for c in runner.worker_kernel_choices] == [("shm", "default")] * 2


def allreduce(choices: list[KernelChoice]) -> tuple[str, str]:
    (c,) = [c for c in choices if c.role == "tp_allreduce"]
    return c.choice, c.source


def test_gloo_gives_the_same_tokens(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """KVSERVE_TP_ALLREDUCE=gloo: the fallback the shared-memory sum replaces (and nccl's shape)."""
    path = str(models["llama-gqa-bias"])
    one = tokens(LLM(path, kv_cache_memory="2MiB", **KW))
    monkeypatch.setenv(ENV, "gloo")  # the workers inherit it
    with LLM(path, kv_cache_memory="1MiB", tensor_parallel_size=2, **KW) as llm:
        assert tokens(llm) == one
        assert [allreduce(c) for c in llm.engine.runner.worker_kernel_choices] == [("gloo", "forced")] * 2


def test_preemption_prefix_hits_drafts_sessions_and_block_scores_match(models: dict[str, Path]) -> None:
    """Everything that changes what the runner keeps between steps: preemption (a 16-block pool),
    prefix hits, n-gram drafts cut at the first rejection (the followers' trims), a session's
    second turn, n > 1, and SnapKV block scores summed over both workers' heads."""
    path = str(models["llama-gqa-bias"])
    repeat = {"prompt_token_ids": [7, 8, 9, 10, 11] * 5}
    press = PressSpec("snapkv", ratio=0.5, sink_tokens=4, recent_tokens=8, observe_tokens=8)

    def workload(llm: LLM) -> list[object]:
        out: list[object] = [tokens(llm)]                                 # 3 requests, 16 blocks: preemption
        out.append(tokens(llm, PROMPTS[2:]))                              # prefix hit
        out.append(tokens(llm, [repeat], SamplingParams(n=2, max_tokens=12, temperature=0.0, ignore_eos=True)))
        out.append(tokens(llm, [{"prompt_token_ids": list(range(40, 80))}], kv_press=press))
        for turn in ([5, 6, 7], [8, 9]):
            out.append(llm.generate({"prompt_token_ids": turn}, GREEDY, session_id="s")[0].outputs[0].token_ids)
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and stats.prefix_hits > 0 and stats.spec_verifies > 0
        return out

    kw = {**KW, "num_blocks": 16, "speculative": "ngram", "num_speculative_tokens": 4}
    one = workload(LLM(path, **kw))
    with LLM(path, tensor_parallel_size=2, **kw) as llm:
        assert workload(llm) == one


def test_each_worker_holds_the_planners_per_gpu_pool(models: dict[str, Path]) -> None:
    path = models["llama-gqa-bias"]
    result = CliRunner().invoke(app, ["plan", "--model", str(path), "--kv-cache-memory", "1MiB",
                                      "--block-size", "4", "--tp", "2", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    with LLM(str(path), kv_cache_memory="1MiB", tensor_parallel_size=2, **KW) as llm:
        cap, runner = llm.engine.capacity, llm.engine.runner
        # 2 layers x 1 of 2 KV heads x head_dim 16 x fp32 x (K, V) per worker
        assert cap.bytes_per_token == plan["bytes_per_token"] == 2 * 1 * 16 * 4 * 2
        assert cap.num_blocks == plan["num_blocks"] == 2**20 // (4 * 256)
        assert runner.worker_kv_bytes == [plan["allocated_bytes"]] * 2 == [cap.allocated_bytes] * 2


def test_a_dead_worker_is_an_error_not_a_hang(models: dict[str, Path]) -> None:
    llm = LLM(str(models["llama-mha"]), kv_cache_memory="1MiB", tensor_parallel_size=2, **KW)
    runner = llm.engine.runner
    assert tokens(llm, PROMPTS[:1])  # up and serving
    os.kill(runner.pids[1], signal.SIGKILL)  # the follower
    t0 = time.monotonic()
    with pytest.raises(RunnerProcessError, match=r"tensor-parallel rank 1 died \(exit code -9\)"):
        tokens(llm, PROMPTS[1:2])
    assert time.monotonic() - t0 < 10
    with pytest.raises(RuntimeError):  # the engine stopped: it does not serve half a model
        tokens(llm, PROMPTS[:1])
    t0 = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - t0 < 5
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in runner.pids if p is not None)


@pytest.mark.parametrize("tp, what", [(3, "num_attention_heads"), (4, "num_key_value_heads")])
def test_a_size_the_model_cannot_split_into_is_refused(models: dict[str, Path], tp: int, what: str) -> None:
    with pytest.raises(ValueError, match=f"tensor_parallel_size {tp} must divide {what}"):
        LLM(str(models["llama-gqa-bias"]), kv_cache_memory="1MiB", tensor_parallel_size=tp, **KW)


def test_the_cli_refuses_in_one_line(models: dict[str, Path]) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "kvserve.cli", "generate", "--prompt", "hi", "--model",
                           str(models["llama-gqa-bias"]), "--tensor-parallel-size", "3", "--quiet"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "kvserve: error: tensor_parallel_size 3 must divide num_attention_heads (4); this model allows 1, 2"]
