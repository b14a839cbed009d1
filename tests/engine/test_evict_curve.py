"""``kvserve eval kv --evict``: the curve's JSON shape, and figures that mean what they say."""

from __future__ import annotations

from typer.testing import CliRunner

from kvserve.eval.evict_curve import Target, curve, plot
from kvserve.eval.kv_quality import EvalConfig, make_engine
from kvserve.eval.retrieval import RetrievalSet, load_heldout, shipped_retrieval_model

SEQS = [[(11 * i + 7 * j) % 4000 + 3 for i in range(72)] for j in range(3)]
ROW = {"retrieval_accuracy", "retrieval_kept", "kl", "delta_ppl_pct", "kept", "tokens_per_gib", "kv_cache_dtype"}


def _chat(tiny_llama, codec: str = "auto"):
    return make_engine(EvalConfig(model=str(tiny_llama), dtype="float32", block_size=4, texts=3,
                                  greedy_prompts=0), codec)


def _retrieval(codec: str = "auto", n: int = 8) -> RetrievalSet:
    path = shipped_retrieval_model()
    examples = tuple(load_heldout(path, n))
    cfg = EvalConfig(model=str(path), texts=n, max_tokens=len(examples[0].prompt) + 2, greedy_prompts=0)
    return RetrievalSet(make_engine(cfg, codec), examples)


def test_curve_shape_and_figures(tiny_llama, tmp_path) -> None:
    engine = _chat(tiny_llama)
    doc = curve(Target(engine), SEQS, ["sinks", "snapkv", "h2o"], [0.0, 0.5], context=48, chunk=8)
    assert set(doc) == {"full", "evict", "codecs"} and doc["full"]["retrieval_accuracy"] is None
    assert doc["codecs"] == {} and doc["full"]["kv_cache_dtype"] == "float32"
    for name in ("sinks", "snapkv", "h2o"):
        rows = doc["evict"][name]
        assert list(rows) == ["0", "0.5"]  # ratios as strings
        assert set(rows["0.5"]) == ROW - {"retrieval_kept"}
        assert rows["0"]["kl"] == 0.0 and rows["0"]["kept"] == 1.0  # ratio 0: the policy is off
        assert rows["0.5"]["kl"] > 0.0 and rows["0.5"]["kept"] < 1.0
        assert rows["0.5"]["tokens_per_gib"] > doc["full"]["tokens_per_gib"]
    assert engine.kv.usage().used == 0
    plot(doc, str(tmp_path / "curve.png"))
    assert (tmp_path / "curve.png").stat().st_size > 1000


def test_retrieval_accuracy_and_codecs_stack(tiny_llama, tmp_path) -> None:
    """The retrieval model fills ``retrieval_accuracy``; under int8 each policy is keyed
    ``POLICY+int8``, measured against the same full-precision reference, with fewer bytes."""
    ref = Target(_chat(tiny_llama), _retrieval())
    int8 = Target(_chat(tiny_llama, "int8"), _retrieval("int8"))
    doc = curve(ref, SEQS, ["sinks"], [0.0, 0.75], context=48, chunk=64, targets=[ref, int8])
    full = doc["full"]["retrieval_accuracy"]
    assert full >= 0.85 and doc["full"]["retrieval_chance"] < 0.05
    rows, q = doc["evict"]["sinks"], doc["evict"]["sinks+int8"]
    assert set(rows["0.75"]) == ROW and rows["0"]["retrieval_accuracy"] == full
    assert rows["0.75"]["retrieval_accuracy"] < full and rows["0.75"]["retrieval_kept"] < 0.4
    assert q["0"]["kv_cache_dtype"] == "int8" and q["0"]["kl"] > 0.0  # the codec alone costs something
    assert q["0.75"]["tokens_per_gib"] > rows["0.75"]["tokens_per_gib"]
    assert doc["codecs"]["int8"]["kl"] == q["0"]["kl"]
    plot(doc, str(tmp_path / "curve.png"))
    assert (tmp_path / "curve.png").stat().st_size > 1000


def test_cli_rejects_bad_input_with_one_line() -> None:
    from kvserve.cli import app

    for args in (["--evict", "bogus"], ["--evict", "sinks", "--ratios", "1.5"],
                 ["--evict", "sinks", "--retrieval-model", "/nonexistent"]):
        result = CliRunner().invoke(app, ["eval", "kv", *args])
        assert result.exit_code == 2, result.output
        assert "error:" in result.output and "Traceback" not in result.output
