"""``kvserve eval kv --evict``: the curve's JSON shape, and figures that mean what they say."""

from __future__ import annotations

from kvserve.eval.evict_curve import curve, plot
from kvserve.eval.kv_quality import EvalConfig, make_engine

SEQS = [[(11 * i + 7 * j) % 4000 + 3 for i in range(72)] for j in range(3)]


def test_curve_shape_and_figures(tiny_llama, tmp_path) -> None:
    engine = make_engine(EvalConfig(model=str(tiny_llama), dtype="float32", block_size=4, texts=3,
                                    greedy_prompts=0), "auto")
    doc = curve(engine, SEQS, ["sinks", "snapkv", "h2o"], [0.0, 0.5], context=48, chunk=8)
    assert set(doc) == {"full", "evict"} and doc["full"]["retrieval_accuracy"] is None
    for name in ("sinks", "snapkv", "h2o"):
        rows = doc["evict"][name]
        assert list(rows) == ["0", "0.5"]  # ratios as strings
        assert set(rows["0.5"]) == {"retrieval_accuracy", "kl", "delta_ppl_pct", "kept", "tokens_per_gib"}
        assert rows["0"]["kl"] == 0.0 and rows["0"]["kept"] == 1.0  # ratio 0: the policy is off
        assert rows["0.5"]["kl"] > 0.0 and rows["0.5"]["kept"] < 1.0
        assert rows["0.5"]["tokens_per_gib"] > doc["full"]["tokens_per_gib"]
    assert engine.kv.usage().used == 0
    plot(doc, str(tmp_path / "curve.png"))
    assert (tmp_path / "curve.png").stat().st_size > 1000
