"""A fault in one request's forward or sampling fails that request only; the others in its batch
finish with the tokens they would have produced alone, and every block comes back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.engine.conftest import write_tiny_llama

POISON = 4000
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
GOOD = [{"prompt_token_ids": [11, 12, 13, 14, 15]}, {"prompt_token_ids": [21, 22, 23]},
        {"prompt_token_ids": [31, 32, 33, 34, 35, 36, 37]}]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("fault") / "m")


def poison_forward(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    model = llm.engine.runner.model
    real = model.forward

    def forward(input_ids: torch.Tensor, *args, **kw):  # type: ignore[no-untyped-def]
        if bool((input_ids == POISON).any()):
            raise RuntimeError("injected fault")
        return real(input_ids, *args, **kw)

    monkeypatch.setattr(model, "forward", forward)


def test_a_failing_forward_fails_only_its_request(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    alone = [LLM(str(model), dtype="float32", kv_cache_memory="2MiB").generate(p, GREEDY)[0].outputs[0].token_ids
             for p in GOOD]
    llm = LLM(str(model), dtype="float32", kv_cache_memory="2MiB")
    poison_forward(llm, monkeypatch)
    bad = {"prompt_token_ids": [41, POISON, 43]}
    outs = llm.generate([GOOD[0], bad, GOOD[1], GOOD[2]], GREEDY)
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2], outs[3])] == alone
    assert outs[1].outputs[0].finish_reason == "error" and "injected fault" in (outs[1].error or "")
    assert outs[1].outputs[0].token_ids == []
    assert llm.engine.kv.usage().used == 0
    llm.engine.kv.check()
    # the engine keeps serving
    assert llm.generate(GOOD[1], GREEDY)[0].outputs[0].token_ids == alone[1]


def test_a_failing_sample_fails_only_its_request(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(model), dtype="float32", kv_cache_memory="2MiB")
    sampler = llm.engine.runner.sampler
    real = sampler._one

    def one(row_logits, row, greedy_id):  # type: ignore[no-untyped-def]
        if row.state.sampling.temperature == 0.5:
            raise FloatingPointError("injected sampling fault")
        return real(row_logits, row, greedy_id)

    monkeypatch.setattr(sampler, "_one", one)
    llm.engine.add_request(GOOD[0], SamplingParams(max_tokens=4, temperature=0.5), request_id="bad")
    llm.engine.add_request(GOOD[1], GREEDY, request_id="good")
    done = {o.request_id: o for o in llm.engine.run_until_done()}
    assert done["bad"].outputs[0].finish_reason == "error" and "injected sampling fault" in done["bad"].error
    assert len(done["good"].outputs[0].token_ids) == 10
    assert llm.engine.kv.usage().used == 0


def test_a_fault_every_request_shares_stops_the_engine(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(model), dtype="float32", kv_cache_memory="2MiB")
    monkeypatch.setattr(llm.engine.runner.model, "forward", lambda *a, **k: (_ for _ in ()).throw(MemoryError()))
    with pytest.raises(MemoryError):
        llm.generate(GOOD[:2], GREEDY)
