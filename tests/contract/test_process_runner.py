"""``runner="process"``: the model and KV storage in a child process give the same greedy tokens as
the inline runner, through preemption, prefix hits, sessions and ``n > 1``; a dead child is an
error, not a hang."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.runner.process_runner import RunnerProcessError
from tests.engine.conftest import TOKENIZER_DIR, write_tiny_llama
from tests.model.helpers import PARITY_CASES, build_hf_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5 + i, 17, 33 + 2 * i, 40, 41, 42, 9 + i][: 3 + i]} for i in range(4)]


def tokens(llm: LLM, prompts=PROMPTS, params=GREEDY, **kw) -> list[list[list[int]]]:  # type: ignore[no-untyped-def]
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, **kw)]


@pytest.fixture(scope="module")
def parity_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for case in PARITY_CASES:
        out = tmp_path_factory.mktemp(case)
        build_hf_model(case).save_pretrained(out)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TOKENIZER_DIR / name, out / name)
        dirs[case] = out
    return dirs


@pytest.mark.parametrize("case", sorted(PARITY_CASES))
def test_process_runner_matches_inline_on_every_parity_case(parity_dirs: dict[str, Path], case: str) -> None:
    prompts = [{"prompt_token_ids": list(range(3 + i, 3 + i + 20 + 7 * i))} for i in range(3)]  # past the window
    kw = {"dtype": "float32", "kv_cache_memory": "4MiB", "block_size": 4, "max_num_batched_tokens": 16,
          "num_threads": 1}
    inline = tokens(LLM(str(parity_dirs[case]), **kw), prompts)
    with LLM(str(parity_dirs[case]), runner="process", **kw) as llm:
        assert tokens(llm, prompts) == inline


def test_process_runner_with_preemption_prefix_hits_sessions_and_n(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m")
    kw = {"dtype": "float32", "num_blocks": 14, "block_size": 4, "max_num_batched_tokens": 16, "num_threads": 1}
    sampled = SamplingParams(n=3, max_tokens=8, temperature=0.9, seed=5, ignore_eos=True)

    def workload(llm: LLM) -> tuple[object, ...]:
        first = tokens(llm)                                # 4 requests in a 14-block pool: preemption
        again = llm.generate(PROMPTS[3], GREEDY)[0]       # prefix hit on the earlier prompt
        fan = tokens(llm, PROMPTS[:1], sampled)            # n > 1, seeded sampling
        t1 = llm.generate({"prompt_token_ids": [7, 8, 9]}, GREEDY, session_id="s")[0]
        t2 = llm.generate({"prompt_token_ids": [10, 11]}, GREEDY, session_id="s")[0]
        stats = llm.engine.stats()
        llm.engine.kv.check()
        return (first, again.outputs[0].token_ids, again.num_cached_tokens, fan, t1.outputs[0].token_ids,
                t2.outputs[0].token_ids, t2.num_cached_tokens, stats.num_preemptions > 0)

    inline = workload(LLM(str(model), **kw))
    assert inline[2] > 0 and inline[6] > 0 and inline[-1]  # the workload did hit, reuse and preempt
    with LLM(str(model), runner="process", **kw) as llm:
        assert workload(llm) == inline


def test_a_dead_runner_process_is_an_error_not_a_hang(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m")
    llm = LLM(str(model), dtype="float32", kv_cache_memory="1MiB", runner="process", num_threads=1)
    try:
        assert tokens(llm, PROMPTS[:1])
        os.kill(llm.engine.runner.pid, signal.SIGKILL)
        with pytest.raises(RunnerProcessError, match="died"):
            llm.generate(PROMPTS[0], GREEDY)
    finally:
        llm.shutdown()
