"""The training loop on a toy corpus: seeded runs repeat exactly and write a loadable checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvserve.tiny import tokenizer as tk
from kvserve.tiny import train as tr

TEXTS = [f"<|im_start|>user\nWrite f{i}.<|im_end|>\n<|im_start|>assistant\ndef f{i}(x):\n    return x * {i}<|im_end|>\n"
         for i in range(40)]


def _cfg(**kw) -> tr.TrainConfig:
    base = {"num_layers": 1, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64,
            "vocab_size": 300, "max_position_embeddings": 64, "seq_len": 16, "batch_size": 2, "steps": 4,
            "warmup_steps": 2, "eval_windows": 2, "threads": 1}
    return tr.TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def corpus() -> tr.Corpus:
    tok = tk.train_tokenizer(TEXTS, vocab_size=300)
    return tr.Corpus(tok, tr.token_stream(tok, TEXTS[:30]), tr.token_stream(tok, TEXTS[30:]))


def test_seeded_runs_repeat_and_checkpoint_loads(tmp_path: Path, corpus: tr.Corpus) -> None:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, LlamaForCausalLM

    a = tr.train(_cfg(), tmp_path / "a", log_path=tmp_path / "a.log", corpus=corpus)
    b = tr.train(_cfg(), tmp_path / "b", corpus=corpus)
    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    drop = {"train_s"}
    assert {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}
    assert a["steps"] == 4
    assert all(t.dtype == torch.bfloat16 for t in wa.values())
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["num_key_value_heads"] == 2 and cfg["tie_word_embeddings"] is True
    gen = json.loads((tmp_path / "a" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 0]
    model = LlamaForCausalLM.from_pretrained(tmp_path / "a", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tmp_path / "a", local_files_only=True)
    assert model.config.vocab_size == 300 and tok.convert_tokens_to_ids(tk.IM_END) == 2
    events = [json.loads(line)["event"] for line in (tmp_path / "a.log").read_text().splitlines()]
    assert events[0] == "start" and events[-1] == "done"


def test_other_seed_gives_other_weights(tmp_path: Path, corpus: tr.Corpus) -> None:
    from safetensors.torch import load_file

    tr.train(_cfg(steps=1), tmp_path / "a", corpus=corpus)
    tr.train(_cfg(steps=1, seed=1), tmp_path / "b", corpus=corpus)
    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert not torch.equal(wa["model.embed_tokens.weight"], wb["model.embed_tokens.weight"])


def test_training_lowers_the_loss(tmp_path: Path, corpus: tr.Corpus) -> None:
    summary = tr.train(_cfg(steps=40, lr=1e-2, batch_size=4), tmp_path / "m", log_path=tmp_path / "log",
                       corpus=corpus)
    first = next(json.loads(x) for x in (tmp_path / "log").read_text().splitlines() if '"step"' in x)
    assert summary["final_train_loss"] < first["loss"] - 1.0


def test_schedule_warms_up_then_decays_to_floor() -> None:
    cfg = _cfg(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, steps=100)
    warm = [tr.lr_at(s, 100, cfg) for s in range(10)]
    assert warm == sorted(warm) and warm[-1] == pytest.approx(1.0)
    decay = [tr.lr_at(s, 100, cfg) for s in range(10, 101)]
    assert decay == sorted(decay, reverse=True)
    assert decay[-1] == pytest.approx(0.1)
    assert tr.lr_at_fraction(50, 1.0, cfg) == pytest.approx(0.1)
    assert tr.lr_at_fraction(50, 0.0, cfg) == pytest.approx(1.0)


@pytest.mark.parametrize("kw, match", [
    ({"steps": None, "minutes": None}, "steps or minutes"),
    ({"steps": 0}, "steps"),
    ({"num_heads": 3}, "multiple of num_heads"),
    ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
    ({"seq_len": 128}, "max_position_embeddings"),
    ({"dtype": "float16"}, "bfloat16 or float32"),
])
def test_bad_config_is_rejected(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)
