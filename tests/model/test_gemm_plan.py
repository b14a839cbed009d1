"""GEMM paths chosen per machine and row band: the decision, the cache, forcing, the fallback
without a fast half path, and the applied model against transformers (timings faked: no test
depends on this machine's speed)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvserve.bench.machine import last_level_cache_bytes
from kvserve.model import decode_stack, gemm_plan
from kvserve.model.cpu_gemm import PackedFp16Linear, fbgemm_fp16_available
from kvserve.model.gemm_apply import apply_plan, lm_head_reads_embedding
from kvserve.model.gemm_paths import BANDS, ROLES, BandDispatch, NativeLinear, NativeMLP, band_of, storage_of
from kvserve.model.gemm_plan import STORAGE_TIE, GemmPlan, decide, plan_for, uniform
from kvserve.model.gemm_tune import MIN_DECODE_WORKING_SET, RoleShape, decode_working_set, role_shapes
from kvserve.model.loader import load_model
from kvserve.model.row_blocks import ROW_BLOCK
from kvserve.native import choices

from .helpers import PagedRunner, check_bf16_against_transformers, random_prompt

Checkpoint = Callable[[str], tuple[Path, torch.nn.Module]]
needs_fbgemm = pytest.mark.skipif(not fbgemm_fp16_available(), reason="no FBGEMM in this torch build")
BIG = role_shapes(896, 4864, 896, 128, 151936, 24)  # the 0.5B shape: above the tuning threshold
X = "fbgemm_fp16_x1"


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the GEMM cache only: the native build cache stays where it is (a rebuild costs ~50 s)
    monkeypatch.setattr(gemm_plan, "cache_dir", lambda: tmp_path / "cache")
    for var in ("KVSERVE_GEMM", "KVSERVE_RETUNE_KERNELS", "KVSERVE_GEMM_EXTRA_MIB"):
        monkeypatch.delenv(var, raising=False)
    choices.clear()


def fake_timings(per_band: list[dict[str, float]]) -> Callable[..., dict[str, list[dict[str, float]]]]:
    calls: list[int] = []

    def measure(roles: tuple[RoleShape, ...], paths: tuple[str, ...], dtype: torch.dtype,
                timer: object = None) -> dict[str, list[dict[str, float]]]:
        calls.append(1)
        return {r.role: [{p: b[p] for p in paths if p in b} for b in per_band] for r in roles}

    measure.calls = calls  # type: ignore[attr-defined]
    return measure


def test_agreeing_bands_take_one_path_and_disagreeing_ones_split_within_the_budget() -> None:
    bands = [{"native": 3.0, X: 1.0}, {"native": 1.0, X: 2.0}, {"native": 1.0, X: 4.0}]
    same = [{"native": 3.0, X: 1.0}] * 3
    plan = decide({"qkv": bands, "o": same}, {"qkv": 100, "o": 100}, extra_budget=100, source="measured")
    assert plan.paths == {"qkv": (X, "native", "native"), "o": (X, X, X)} and plan.extra_bytes == 100
    # over the budget: one path, the one whose worst slowdown is smallest (native: 3x at one row
    # against FBGEMM's 4x at many rows)
    tight = decide({"qkv": bands}, {"qkv": 100}, extra_budget=99, source="measured")
    assert tight.paths == {"qkv": ("native",) * 3} and tight.extra_bytes == 0


def test_cheapest_splits_are_kept_first() -> None:
    bands = [{"native": 3.0, X: 1.0}, {"native": 1.0, X: 2.0}, {"native": 1.0, X: 2.0}]
    plan = decide({"qkv": bands, "mlp": bands}, {"qkv": 10, "mlp": 1000}, extra_budget=500, source="measured")
    # mlp over the budget: one path, FBGEMM (at worst 2x slower) rather than native (3x at one row)
    assert plan.paths["qkv"] == (X, "native", "native") and plan.paths["mlp"] == (X,) * 3


@needs_fbgemm
def test_measured_once_then_cached_and_retuned_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    measure = fake_timings([{"native": 5.0, X: 1.0, "fbgemm_fp16_x2": 2.0}] * len(BANDS))
    monkeypatch.setattr(gemm_plan, "measure", measure)
    first = plan_for(BIG, torch.bfloat16)
    assert first.source == "measured" and first.paths["mlp"] == (X,) * len(BANDS)
    assert len(list((gemm_plan.cache_dir() / "gemm").glob("*.json"))) == 1
    second = plan_for(BIG, torch.bfloat16)
    assert second.source == "cached" and second.paths == first.paths and len(measure.calls) == 1  # type: ignore[attr-defined]
    monkeypatch.setenv("KVSERVE_RETUNE_KERNELS", "1")
    assert plan_for(BIG, torch.bfloat16).source == "measured" and len(measure.calls) == 2  # type: ignore[attr-defined]
    # another shape is another cache entry
    monkeypatch.delenv("KVSERVE_RETUNE_KERNELS")
    plan_for(role_shapes(1024, 4096, 1024, 256, 32000, 16), torch.bfloat16)
    assert len(measure.calls) == 3  # type: ignore[attr-defined]


@needs_fbgemm
def test_a_corrupt_cache_is_measured_again(monkeypatch: pytest.MonkeyPatch) -> None:
    measure = fake_timings([{"native": 1.0, X: 2.0}] * len(BANDS))
    monkeypatch.setattr(gemm_plan, "measure", measure)
    path = gemm_plan.cache_path(BIG, torch.bfloat16)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert plan_for(BIG, torch.bfloat16).source == "measured"
    assert set(json.loads(path.read_text())["timings_us"]) == {"qkv", "o", "mlp", "lm_head"}


def test_every_choice_is_recorded_with_its_timings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemm_plan, "candidate_paths", lambda: ("native", X))
    monkeypatch.setattr(gemm_plan, "measure", fake_timings([{"native": 1.0, X: 2.0}] * len(BANDS)))
    plan_for(BIG, torch.bfloat16)
    got = {(c.role, c.band): c for c in choices.choices()}
    assert set(got) == {(f"gemm_{r}", b) for r in ("qkv", "o", "mlp", "lm_head") for b in BANDS}
    c = got[("gemm_mlp", "rows<=16")]
    assert c.choice == "native" and c.timings_us == {"native": 1.0, X: 2.0} and c.source == "measured"


def test_tiny_and_fp32_models_take_the_default_without_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemm_plan, "measure", lambda *a, **k: pytest.fail("tiny models are not timed"))
    # nor do they ask for the candidates (that would build the tiled kernel, ~60 s on a cold cache)
    monkeypatch.setattr(gemm_plan, "candidate_paths", lambda: pytest.fail("tiny models build nothing"))
    tiny = role_shapes(64, 128, 64, 32, 512, 2)
    assert plan_for(tiny, torch.bfloat16).source == "default"
    assert plan_for(BIG, torch.float32) == uniform("native", "default")
    # the default follows the CPU: native where it multiplies bf16 in hardware
    monkeypatch.setattr(gemm_plan, "_cpu", lambda: {"model": "x", "flags": ["avx512f", "amx_bf16"]})
    assert plan_for(tiny, torch.bfloat16).paths["qkv"] == ("native",) * len(BANDS)
    monkeypatch.setattr(gemm_plan, "_cpu", lambda: {"model": "x", "flags": ["avx2", "fma"]})
    want = "fbgemm_fp16" if fbgemm_fp16_available() else "native"
    assert plan_for(tiny, torch.bfloat16).paths["qkv"] == (want,) * len(BANDS)


def test_the_embedded_chat_model_is_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its small matrices are where torch's bf16 matmul costs most per call: it is measured."""
    from kvserve.assets import default_model_path
    from kvserve.model.loader import load_model_config

    c = load_model_config(default_model_path())
    shapes = role_shapes(c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim,
                         c.num_key_value_heads * c.head_dim, c.vocab_size, c.num_hidden_layers)
    timed: list[tuple[str, ...]] = []
    monkeypatch.setattr(gemm_plan, "candidate_paths", lambda: ("native", "fbgemm_fp16_x1"))
    monkeypatch.setattr(gemm_plan, "_read_cache", lambda path: None)
    monkeypatch.setattr(gemm_plan, "_write_cache", lambda path, timings: None)

    def fake_measure(roles, order, dtype, timer):  # type: ignore[no-untyped-def]
        timed.append(order)
        return {r.role: [{p: 1.0 + i for i, p in enumerate(order)} for _ in BANDS] for r in roles}

    monkeypatch.setattr(gemm_plan, "measure", fake_measure)
    assert plan_for(shapes, torch.bfloat16).source == "measured"
    assert timed


def test_forcing_a_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_GEMM", "native")
    assert plan_for(BIG, torch.bfloat16) == uniform("native", "forced")
    monkeypatch.setenv("KVSERVE_GEMM", "tensor_cores")
    with pytest.raises(ValueError, match="not a GEMM path"):
        plan_for(BIG, torch.bfloat16)


def test_without_a_fast_half_path_the_model_loads_native(hf_checkpoint: Checkpoint,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemm_plan, "candidate_paths", lambda: ("native",))
    monkeypatch.setattr(gemm_plan, "fbgemm_fp16_available", lambda: False)
    monkeypatch.setattr(gemm_plan, "measure", lambda *a, **k: pytest.fail("nothing to choose between"))
    model, config = load_model(hf_checkpoint("llama-gqa")[0], dtype="bf16")
    assert not any(isinstance(m, (PackedFp16Linear, BandDispatch)) for m in model.modules())
    # (native_target: recorded by the first native build in this process, which load_model may be)
    assert {c.choice for c in choices.choices() if c.role != "native_target"} == {"native"}
    runner = PagedRunner(model, config)
    prompt = random_prompt(8, config.vocab_size)
    assert torch.isfinite(runner.prefill(prompt, runner.new_block_table(8))).all()


def test_band_of() -> None:
    assert BANDS == ("rows<=1", "rows<=16", "rows<=64", "rows<=128", "rows>128")
    assert [band_of(n) for n in (0, 1, 2, 16, 17, 64, 65, 128, 129, 4096)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_a_plan_decided_on_fewer_bands_uses_the_bands_it_was_given() -> None:
    """The decision takes as many bands as the timings have (the recorded machines' timings
    below are three bands, from before the 64-row band), and ranks families on every one."""
    four = [{"native": 3.0, X: 1.0}, {"native": 1.0, X: 2.0}, {"native": 1.0, X: 4.0}, {"native": 1.0, X: 8.0}]
    plan = decide({"qkv": four}, {"qkv": 100}, extra_budget=100, source="measured")
    assert plan.paths == {"qkv": (X, "native", "native", "native")}
    assert decide({"qkv": four[:3]}, {"qkv": 100}, 100, "measured").paths == {"qkv": (X, "native", "native")}


@needs_fbgemm
@pytest.mark.parametrize("case", ["llama-gqa", "qwen2-bias-tied"])
def test_a_split_plan_matches_transformers_in_every_band(case: str, hf_checkpoint: Checkpoint) -> None:
    """FBGEMM for one row, native for 2-16, sharded FBGEMM above: prefill (20 rows: the 64-row
    band), a batch of 4 decodes and single decodes all agree with transformers to bf16 rounding."""
    path, hf = hf_checkpoint(case)
    model, config = load_model(path, dtype="bf16", cpu_fp16_gemm=False)
    split = (X, "native", "fbgemm_fp16_x2", "fbgemm_fp16_x2")
    plan = GemmPlan({r: split for r in ("qkv", "o", "mlp", "lm_head")}, "forced")
    assert apply_plan(model, plan) == 3 * config.num_hidden_layers + 1
    heads = [m for m in model.modules() if isinstance(m, BandDispatch)]
    assert len(heads) == 3 * config.num_hidden_layers + 1 and heads[0].names == split
    if case == "qwen2-bias-tied":  # the native band multiplies by the embedding itself
        assert lm_head_reads_embedding(model)
    check_bf16_against_transformers(model, config, hf)  # 20-row prefills: x2 band; 4 decodes: native; 1: X


def test_a_split_between_native_and_the_tiled_kernel_costs_no_memory() -> None:
    """The two read the same loaded tensor, so a split between them is kept with no budget at all,
    while one with an FBGEMM band needs its copy's bytes."""
    tiled = "kvserve_tiled"
    mlp = [{"native": 30.0, tiled: 10.0, X: 25.0}, {"native": 10.0, tiled: 30.0, X: 25.0},
           {"native": 100.0, tiled: 300.0, X: 120.0}]
    plan = decide({"mlp": mlp}, {"mlp": 1 << 30}, 0, "measured")
    assert plan.paths["mlp"] == (tiled, "native", "native") and plan.extra_bytes == 0
    with_x1 = [{"native": 30.0, X: 10.0}, {"native": 10.0, X: 30.0}, {"native": 100.0, X: 300.0}]
    assert decide({"mlp": with_x1}, {"mlp": 1 << 30}, 0, "measured").paths["mlp"] == ("native",) * 3
    plan = decide({"mlp": with_x1}, {"mlp": 1 << 30}, 1 << 30, "measured")
    assert plan.paths["mlp"] == (X, "native", "native") and plan.extra_bytes == 1 << 30
    # a band where FBGEMM only ties the tiled kernel (within 5 %) takes the free one
    tie = [{"native": 30.0, tiled: 10.3, X: 10.0}, {"native": 10.0, tiled: 30.0, X: 40.0},
           {"native": 100.0, tiled: 300.0, X: 400.0}]
    plan = decide({"mlp": tie}, {"mlp": 1 << 30}, 1 << 30, "measured")
    assert plan.paths["mlp"] == (tiled, "native", "native") and plan.extra_bytes == 0


def test_a_storage_is_judged_by_its_best_path_in_each_band() -> None:
    """The AVX-512 AMD EPYC's MLP and logits (session 9, µs): oneDNN's reordered copy is the best
    single path (worst 1.4x at one row) but the loaded tensor, the tiled kernel for few rows and
    torch's matmul for many, is at worst 1.19x: with no budget for a second copy the role takes
    the loaded tensor, split between its two paths for free."""
    tiled, onednn = "kvserve_tiled", "onednn_packed"
    mlp = [{"native": 1573.0, tiled: 1052.0, onednn: 1507.0}, {"native": 2598.0, tiled: 2333.0, onednn: 1966.0},
           {"native": 23947.0, tiled: 56548.0, onednn: 24000.0}]
    plan = decide({"mlp": mlp}, {"mlp": 598 << 20}, 64 << 20, "measured")
    assert plan.paths["mlp"] == (tiled, tiled, "native") and plan.extra_bytes == 0
    # with room for oneDNN's copy too, its 16-row band (1.19x faster) is worth it
    plan = decide({"mlp": mlp}, {"mlp": 598 << 20}, 1 << 30, "measured")
    assert plan.paths["mlp"] == (tiled, onednn, "native") and plan.extra_bytes == 598 << 20


def test_the_loaded_tensor_wins_a_near_tie_between_storages() -> None:
    """Session 12's Zen 4 MLP timings (µs, bands 1/16/64/256 rows): oneDNN's copy is worst at one
    row (1.60x), the loaded tensor at 256 (1.66x). Within STORAGE_TIE of each other, the loaded
    tensor is kept; past it, the less slow storage still wins."""
    tiled, onednn = "kvserve_tiled", "onednn_packed"
    mlp = [{"native": 3653.0, tiled: 1283.0, onednn: 2055.0}, {"native": 3998.0, tiled: 2361.0, onednn: 2689.0},
           {"native": 7997.0, tiled: 7766.0, onednn: 6771.0}, {"native": 43992.0, tiled: 65911.0, onednn: 26541.0}]
    plan = decide({"mlp": mlp}, {"mlp": 598 << 20}, 0, "measured")
    assert plan.paths["mlp"] == (tiled, tiled, tiled, "native")
    far = [dict(b) for b in mlp]
    far[3]["native"] = 26541.0 * 1.60 * STORAGE_TIE * 1.05  # loaded's worst past the tie
    assert decide({"mlp": far}, {"mlp": 598 << 20}, 0, "measured").paths["mlp"] == (onednn,) * 4


def test_a_split_may_add_one_storage_where_all_bands_best_would_not_fit() -> None:
    """Every band on its fastest path would keep three storages; one extra (FBGEMM's copy for a
    decode, 1.6x faster) fits the budget and is kept."""
    tiled, onednn = "kvserve_tiled", "onednn_packed"
    qkv = [{"native": 259.0, X: 101.0, tiled: 163.0, onednn: 195.0}, {"native": 336.0, X: 426.0, tiled: 219.0,
           onednn: 248.0}, {"native": 1558.0, X: 6691.0, tiled: 4265.0, onednn: 1427.0}]
    plan = decide({"qkv": qkv}, {"qkv": 47 << 20}, 64 << 20, "measured")
    assert plan.paths["qkv"] == (X, tiled, "native") and plan.extra_bytes == 47 << 20
    plan = decide({"qkv": qkv}, {"qkv": 47 << 20}, 40 << 20, "measured")  # no room: the loaded tensor alone
    assert plan.paths["qkv"] == (tiled, tiled, "native") and plan.extra_bytes == 0


def test_native_linear_is_the_loaded_weight() -> None:
    w = torch.randn(8, 4, dtype=torch.bfloat16)
    lin = NativeLinear(w, None, torch.float32)
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    assert lin.weight is w and lin(x).dtype == torch.float32
    assert torch.equal(lin(x), torch.nn.functional.linear(x, w).float())


def test_openmp_paths_and_pool_shards_never_share_a_plan() -> None:
    """Each role alone would take the tiled kernel for qkv and the pooled FBGEMM shards for the
    MLP; the plan takes one family, the one whose forward (summed over the layers) loses least in
    its worst band."""
    x2, tiled = "fbgemm_fp16_x2", "kvserve_tiled"
    qkv = [{"native": 9.0, X: 3.0, x2: 4.0, tiled: 1.0}] * 3
    mlp = [{"native": 90.0, X: 30.0, x2: 10.0, tiled: 11.0}] * 3
    plan = decide({"qkv": qkv, "mlp": mlp}, {"qkv": 1, "mlp": 1}, 0, "measured", {"qkv": 24, "mlp": 24})
    assert plan.paths == {"qkv": (tiled,) * 3, "mlp": (tiled,) * 3}  # 24 * 12 against 24 * 13 (x1 + x2)
    slow = [{"native": 90.0, X: 30.0, x2: 10.0, tiled: 20.0}] * 3
    plan = decide({"qkv": qkv, "mlp": slow}, {"qkv": 1, "mlp": 1}, 0, "measured", {"qkv": 24, "mlp": 24})
    assert plan.paths == {"qkv": (X,) * 3, "mlp": (x2,) * 3}
    assert plan.timings_us["qkv"] == qkv  # every path's timing is kept for the record


def test_one_row_timings_run_past_the_last_level_cache_but_not_past_the_model(tmp_path: Path) -> None:
    """A decode streams the model's weights from memory, so one-row timings must too: 1.5x the
    cache (read from sysfs), capped at the model's own weights (a model that fits decodes from
    the cache), at least the floor."""
    for level, kind, size in ((1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "2048K"),
                              (3, "Unified", "480M")):
        d = tmp_path / f"index{level}{kind[0]}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    llc = last_level_cache_bytes(tmp_path)
    assert llc == 480 << 20
    assert last_level_cache_bytes(tmp_path / "absent") is None
    big = role_shapes(896, 4864, 896, 128, 151936, 24)  # 494M elements
    assert decode_working_set(big, torch.bfloat16, llc) == int(1.5 * llc) // 2
    assert decode_working_set(big, torch.bfloat16, 32 << 20) == 24 << 20  # a 32 MiB L3: 48 MiB of bf16
    assert decode_working_set(big, torch.bfloat16, 8 << 20) == MIN_DECODE_WORKING_SET
    assert decode_working_set(big, torch.bfloat16, None) == MIN_DECODE_WORKING_SET
    mid = role_shapes(2048, 8192, 2048, 512, 32000, 4)  # 301M elements, under 1.5x the cache
    assert decode_working_set(mid, torch.bfloat16, llc) == sum(r.elements * r.count for r in mid)


@pytest.mark.parametrize("rows", [1, 512, 513, 1100])
def test_the_native_mlp_runs_long_prompts_in_row_blocks_with_the_same_result(rows: int) -> None:
    g = torch.Generator().manual_seed(7)
    gate_up, down = torch.randn(2 * 24, 16, generator=g).bfloat16(), torch.randn(16, 24, generator=g).bfloat16()
    x = torch.randn(rows, 16, generator=g).bfloat16()
    calls: list[int] = []
    mlp = NativeMLP(gate_up, down)
    rows_fn = mlp._rows
    mlp._rows = lambda t: (calls.append(t.shape[0]), rows_fn(t))[1]  # type: ignore[method-assign]
    got = mlp(x)
    assert max(calls) <= ROW_BLOCK and sum(calls) == rows
    assert torch.allclose(got.float(), rows_fn(x).float(), rtol=1e-2, atol=1e-2)  # the same rows, one call


def test_a_close_call_is_timed_again_alternating_and_a_clear_one_is_not() -> None:
    """Paths are timed one after another, so a drift of the host lands on one of them; the
    fastest (up to REMATCH_MAX) within REMATCH_WITHIN of the best are timed again in alternation
    and those medians count."""
    from kvserve.model import gemm_tune

    built: list[str] = []
    order: list[str] = []
    true_s = {"kvserve_tiled": 8e-6, "onednn_packed": 10e-6}

    def build(path: str) -> list[torch.nn.Module]:
        built.append(path)
        m = torch.nn.Identity()
        m.path = path  # type: ignore[assignment]
        return [m]

    def time_pass(mods: list[torch.nn.Module], x: torch.Tensor) -> float:
        order.append(mods[0].path)  # type: ignore[arg-type]
        return true_s[mods[0].path]  # type: ignore[index]

    x = torch.zeros(1, 4)
    # the tiled kernel was timed during a slow minute: 12 µs against oneDNN's 10, a close call
    got = gemm_tune.rematch({"onednn_packed": 10.0, "kvserve_tiled": 12.0, "native": 40.0}, build, x, 1.0, time_pass)
    assert got == pytest.approx({"onednn_packed": 10.0, "kvserve_tiled": 8.0, "native": 40.0})
    assert sorted(built) == ["kvserve_tiled", "onednn_packed"] and "native" not in order
    timed = order[2:]  # after one warm call each
    assert len(timed) == 2 * gemm_tune.REMATCH_PASSES and timed[:4] == ["onednn_packed", "kvserve_tiled",
                                                                           "kvserve_tiled", "onednn_packed"]
    # a scale (a cut matrix's work) applies as in the first timing
    assert gemm_tune.rematch({"onednn_packed": 10.0, "kvserve_tiled": 12.0}, build, x, 2.0, time_pass)[
        "kvserve_tiled"] == pytest.approx(16.0)
    built.clear()
    clear = {"onednn_packed": 10.0, "kvserve_tiled": 10.0 * gemm_tune.REMATCH_WITHIN + 1}
    assert gemm_tune.rematch(clear, build, x, 1.0, time_pass) == clear and built == []
    assert gemm_tune.rematch({"native": 3.0}, build, x, 1.0, time_pass) == {"native": 3.0}
    # session 18's case: four close paths, the truly fastest timed fourth during a slow minute
    built.clear()
    order.clear()
    true_s.update(native=9e-6, fbgemm_fp16_x1=9.5e-6)
    got = gemm_tune.rematch({"onednn_packed": 10.0, "native": 11.0, "fbgemm_fp16_x1": 12.0, "kvserve_tiled": 14.0,
                             "fbgemm_fp16_x2": 16.0}, build, x, 1.0, time_pass)
    assert gemm_tune.REMATCH_MAX == 4 and len(built) == 4 and "fbgemm_fp16_x2" not in order  # 1.6x: not close
    assert min(got, key=got.__getitem__) == "kvserve_tiled" and got["fbgemm_fp16_x2"] == 16.0
    four = ["onednn_packed", "native", "fbgemm_fp16_x1", "kvserve_tiled"]
    assert order[4:12] == four + four[::-1]


def test_cached_timings_are_keyed_by_the_openmp_wait_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan timed under PASSIVE (every call wakes the workers) is not reused under the default
    (they spin), nor the attention backend's timings: multi-threaded calls cost up to 2x more."""
    from kvserve.model import attention_choice

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    gemm_default = gemm_plan.cache_path(BIG, torch.bfloat16)
    attn_default = attention_choice.cache_key(14, 2, 64, 16, torch.bfloat16)
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert gemm_plan.cache_path(BIG, torch.bfloat16) != gemm_default
    assert attention_choice.cache_key(14, 2, 64, 16, torch.bfloat16) != attn_default
    monkeypatch.setenv("OMP_WAIT_POLICY", " ")
    assert gemm_plan.cache_path(BIG, torch.bfloat16) == gemm_default


def test_a_band_keeps_the_native_layer_loop_when_its_layer_roles_lose_little_on_the_tiled_kernel() -> None:
    """Steps of up to 128 rows run every layer in one native call only where qkv, o and the MLP of
    the step's band are all on the tiled kernel (kvserve.model.decode_stack); that call saves more
    than LAYER_LOOP_SAVING_US a layer. A layer role a little faster on torch's matmul in such a
    band goes to the tiled kernel; one much faster stays; the band above 128 rows is never moved,
    and without all three layer roles timed (so the loop cannot be judged) nothing moves."""
    tiled, layers = "kvserve_tiled", 24
    assert gemm_plan.LOOP_BANDS == 4 and decode_stack.MAX_ROWS == 128
    fast = [{"native": 3000.0, tiled: 1000.0}] * 5
    close = [{"native": 1000.0, tiled: 3000.0}] + [{"native": 1000.0, tiled: 1080.0}] * 4  # -80 µs a layer
    counts = {"qkv": layers, "o": layers, "mlp": layers, "lm_head": 1}
    rb = {"qkv": 1, "o": 1, "mlp": 1, "lm_head": 1}
    plan = decide({"qkv": fast, "o": fast, "mlp": close, "lm_head": fast}, rb, 0, "measured", counts)
    assert plan.paths["mlp"] == ("native", tiled, tiled, tiled, "native")  # rows<=1: 2,000 µs a layer is too much
    assert plan.paths["qkv"] == plan.paths["o"] == (tiled,) * 5
    # the loss is summed over the band's layer roles: two roles 45 µs a layer slower each (90 in
    # all) still fit under the saving, two 55 slower (110) do not
    def off_by(us: float) -> list[dict[str, float]]:
        return [{"native": 1000.0, tiled: 3000.0}] + [{"native": 1000.0, tiled: 1000.0 + us}] * 4

    assert gemm_plan.LAYER_LOOP_SAVING_US == 100.0  # what the two cases below straddle
    two = decide({"qkv": off_by(45), "o": fast, "mlp": off_by(45)}, rb, 0, "measured", counts).paths
    assert two["qkv"][1:4] == two["mlp"][1:4] == (tiled, tiled, tiled) and two["mlp"][4] == "native"
    apart = decide({"qkv": off_by(55), "o": fast, "mlp": off_by(55)}, rb, 0, "measured", counts).paths
    assert apart["qkv"][1:4] == apart["mlp"][1:4] == ("native", "native", "native")
    # no o timed: the loop's condition cannot be judged, the timings alone decide
    assert decide({"qkv": fast, "mlp": close}, rb, 0, "measured", counts).paths["mlp"] == ("native",) * 5


def test_keeping_the_layer_loop_never_exceeds_the_memory_budget() -> None:
    """Moving a band of a role held in another copy (oneDNN's packed weights) to the tiled kernel
    keeps the loaded tensor too: that copy must fit the extra budget like any split."""
    tiled, onednn = "kvserve_tiled", "onednn_packed"
    counts = {"qkv": 24, "o": 24, "mlp": 24}
    fast = [{"native": 3000.0, tiled: 1000.0}] * 4
    mlp = [{onednn: 1000.0, tiled: 3000.0}, {onednn: 1000.0, tiled: 1050.0}, {onednn: 1000.0, tiled: 3000.0},
           {onednn: 1000.0, tiled: 3000.0}]
    rb = {"qkv": 1, "o": 1, "mlp": 10}
    tight = decide({"qkv": fast, "o": fast, "mlp": mlp}, rb, 9, "measured", counts)
    assert tight.paths["mlp"] == (onednn,) * 4 and tight.extra_bytes == 0
    roomy = decide({"qkv": fast, "o": fast, "mlp": mlp}, rb, 10, "measured", counts)
    assert roomy.paths["mlp"] == (onednn, tiled, onednn, onednn) and roomy.extra_bytes == 10


# The 0.5B shape's one-row ... rows>128 timings (µs) on a 2-core AMX Xeon (session 20), paths in
# the order native, fbgemm_fp16_x1, fbgemm_fp16_x2, kvserve_tiled, onednn_packed.
AMX_XEON = {
    "qkv": [(214, 257, 269, 147, 167), (240, 611, 507, 269, 168), (316, 1451, 1633, 917, 234),
            (328, 1976, 2104, 1388, 251), (387, 4275, 2550, 3597, 394)],
    "o": [(191, 212, 247, 100, 146), (188, 492, 421, 206, 161), (224, 1091, 1186, 713, 204),
          (262, 1537, 1689, 1108, 239), (323, 4409, 4138, 2620, 303)],
    "mlp": [(2590, 3082, 1830, 1717, 1895), (2761, 9210, 5005, 3745, 2145), (4018, 19354, 10468, 11786, 3013),
            (4524, 26448, 15662, 17702, 3851), (18974, 75537, 45725, 50318, 12901)],
    "lm_head": [(19957, 27031, 15825, 14193, 13671), (22510, 90383, 50172, 29630, 13877),
                (32053, 269306, 139977, 113776, 20788), (38583, 389573, 212956, 177049, 27262),
                (91615, 623204, 341121, 424553, 91513)]}

RECORDED_PATHS = ("native", "fbgemm_fp16_x1", "fbgemm_fp16_x2", "kvserve_tiled", "onednn_packed")


def _recorded(table: dict[str, list[tuple[int, ...]]]) -> tuple[dict[str, list[dict[str, float]]], dict[str, int],
                                                                  dict[str, int]]:
    """A recorded table as :func:`decide` takes it: timings per role and band, the 0.5B shape's
    bytes and matrix counts per role."""
    timings = {r: [dict(zip(RECORDED_PATHS, map(float, b))) for b in bands] for r, bands in table.items()}
    return timings, {r.role: r.elements * r.count * 2 for r in BIG}, {r.role: r.count for r in BIG}


def test_on_an_amx_xeon_the_budget_decides_whether_one_row_runs_on_the_tiled_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's packed copy is the MLP's one storage there (worst band 1.10x, the loaded tensor's
    1.47x): within the default budget one-row steps stay on it and off the native layer loop; with
    room for the loaded tensor beside it (``--gemm-extra-memory``) every layer role's one-row band
    goes to the tiled kernel and the loop, and the rest stays on oneDNN."""
    timings, role_bytes, counts = _recorded(AMX_XEON)
    monkeypatch.setenv("KVSERVE_GEMM_EXTRA_MIB", "")  # unset: the default; restored after the test
    default = decide(timings, role_bytes, gemm_plan.extra_budget(), "cached", counts)
    assert default.paths["mlp"] == default.paths["qkv"] == ("onednn_packed",) * 5
    assert default.extra_bytes <= gemm_plan.EXTRA_BYTES_DEFAULT
    gemm_plan.set_extra_budget("1GiB")
    roomy = decide(timings, role_bytes, gemm_plan.extra_budget(), "cached", counts)
    for role in gemm_plan.LAYER_ROLES:
        assert roomy.paths[role] == ("kvserve_tiled",) + ("onednn_packed",) * 4
    assert roomy.extra_bytes == role_bytes["qkv"] + role_bytes["mlp"] + default.extra_bytes <= 1 << 30


@pytest.mark.parametrize(("size", "mib"), [("1GiB", 1024.0), ("600MiB", 600.0), ("0", 0.0), ("1048576", 1.0)])
def test_the_extra_budget_is_read_from_a_size(size: str, mib: float, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_GEMM_EXTRA_MIB", "")  # unset: the default; restored after the test
    assert gemm_plan.extra_budget() == gemm_plan.EXTRA_BYTES_DEFAULT
    gemm_plan.set_extra_budget(size)
    assert gemm_plan.extra_budget() == int(mib * 2**20)


@pytest.mark.parametrize("bad", ["lots", "-5", "nan"])
def test_a_bad_extra_budget_says_what_to_write(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_GEMM_EXTRA_MIB", bad)
    with pytest.raises(ValueError, match="KVSERVE_GEMM_EXTRA_MIB must be a number of MiB >= 0"):
        gemm_plan.extra_budget()
    with pytest.raises(ValueError, match="cannot read memory size"):
        gemm_plan.set_extra_budget(bad if bad != "-5" else "-5MiB")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_bad_gemm_extra_memory_on_the_command_line_is_one_line_before_any_load(
        command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    from kvserve.cli import main

    monkeypatch.setenv("KVSERVE_GEMM_EXTRA_MIB", "")
    args = [command, "--gemm-extra-memory", "lots"] + (["--prompt", "hi"] if command == "generate" else [])
    monkeypatch.setattr(sys, "argv", ["kvserve", *args])
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "cannot read memory size 'lots'" in err[0], err
    assert gemm_plan.extra_budget() == gemm_plan.EXTRA_BYTES_DEFAULT


# The same shape on an AMX Xeon of session 21, with the tiled kernel on AMX tiles (amx_gemm.h):
# it reads the loaded tensor at one row faster than oneDNN's packed copy, and at 16-128 rows about
# as fast (benchmarks/gemm_plan.py). Paths in AMX_XEON's order.
AMX_TILES = {
    "qkv": [(178, 243, 268, 106, 141), (194, 585, 624, 107, 142), (242, 1257, 1334, 183, 189),
            (266, 1782, 1832, 215, 222), (460, 3769, 3734, 347, 347)],
    "o": [(160, 189, 255, 78, 121), (151, 445, 376, 77, 123), (183, 958, 1070, 124, 157),
          (216, 1320, 1398, 154, 195), (275, 3594, 2875, 321, 276)],
    "mlp": [(2076, 2521, 1571, 1298, 1576), (2318, 7460, 4503, 1574, 1823), (3449, 17078, 8870, 2637, 2700),
            (3682, 21930, 11931, 2939, 3178), (11381, 68683, 40984, 12626, 11513)],
    "lm_head": [(17225, 22378, 12009, 11046, 11395), (20894, 85451, 45712, 11368, 12505),
                (28908, 249892, 146202, 18168, 19290), (35078, 373521, 198232, 23410, 24429),
                (90360, 613613, 358808, 73603, 85643)]}


def test_with_amx_tiles_every_role_keeps_the_loaded_tensor_and_no_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the loaded tensor's best path is within the storage tie of oneDNN's copy in every band,
    no role is repacked: the one-row and chat-turn bands run the tiled kernel (and so the native
    layer loop) within the default budget, with no second copy, whatever budget is given."""
    timings, role_bytes, counts = _recorded(AMX_TILES)
    monkeypatch.setenv("KVSERVE_GEMM_EXTRA_MIB", "")
    for budget in (gemm_plan.extra_budget(), 1 << 30):
        plan = decide(timings, role_bytes, budget, "cached", counts)
        assert plan.extra_bytes == 0
        for role in ROLES:
            assert {storage_of(p) for p in plan.paths[role]} == {"loaded"}
            assert plan.paths[role][:4] == ("kvserve_tiled",) * 4


# Session 23, Zen 4 (AMD EPYC, avx512_bf16, no AMX), the 0.5B shape: a start-up measurement whose
# 16-row tiled MLP came out 1.47x oneDNN's copy, and the same role timed again minutes later.
ZEN4_OUTLIER = {
    "qkv": [(141, 120, 155, 82, 119), (202, 380, 292, 126, 153), (461, 1391, 2143, 392, 376),
            (587, 2042, 2019, 563, 514), (1256, 5142, 5148, 3487, 1238)],
    "o": [(108, 92, 125, 51, 82), (165, 309, 245, 89, 114), (334, 1063, 1707, 292, 292),
          (484, 1623, 1588, 424, 410), (955, 4013, 4243, 2309, 954)],
    "mlp": [(1288, 1176, 1020, 882, 989), (2349, 4621, 4083, 2355, 1603), (5233, 16931, 9470, 4536, 4570),
            (7556, 24660, 13100, 7595, 6571), (18488, 72725, 40460, 42161, 17984)],
    "lm_head": [(14788, 9996, 8666, 7836, 11407), (23444, 49948, 27143, 13307, 15070),
                (64345, 178673, 97784, 44612, 48961), (85164, 261111, 158359, 68381, 69772),
                (189587, 763728, 394252, 416939, 177955)]}
ZEN4_MLP_AGAIN = [(1463, 858, 997, 796, 872), (2121, 4614, 2914, 1460, 1616), (5407, 16863, 9347, 4562, 4623),
                  (7226, 25321, 13579, 6863, 6527), (18459, 77575, 41741, 42933, 18081)]


def _measure_in_turn(*tables: dict[str, list[tuple[int, ...]]]) -> Callable[..., dict[str, list[dict[str, float]]]]:
    """A fake ``measure`` answering its n-th call from ``tables[n]`` (the last one repeats), for the
    roles asked; ``calls`` records which roles each call was asked for."""
    calls: list[tuple[str, ...]] = []

    def measure(roles: tuple[RoleShape, ...], paths: tuple[str, ...], dtype: torch.dtype,
                timer: object = None) -> dict[str, list[dict[str, float]]]:
        table = _recorded(tables[min(len(calls), len(tables) - 1)])[0]
        calls.append(tuple(r.role for r in roles))
        return {r.role: [{p: b[p] for p in paths if p in b} for b in table[r.role]] for r in roles}

    measure.calls = calls  # type: ignore[attr-defined]
    return measure


def _all_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemm_plan, "candidate_paths", lambda: RECORDED_PATHS)
    monkeypatch.setenv("KVSERVE_GEMM_EXTRA_MIB", "")


def test_a_plan_that_takes_decode_off_the_loaded_tensor_is_measured_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The outlier alone puts the MLP on oneDNN's copy in every band (decode off the layer loop);
    measured again, each timing the least of the two, the MLP stays on the loaded tensor and one-row
    steps on the tiled kernel. Only the contested role is measured again, and the cache keeps the
    confirmed timings."""
    timings, role_bytes, counts = _recorded(ZEN4_OUTLIER)
    assert decide(timings, role_bytes, gemm_plan.EXTRA_BYTES_DEFAULT, "measured", counts).paths["mlp"] == \
        ("onednn_packed",) * 5
    _all_paths(monkeypatch)
    measure = _measure_in_turn(ZEN4_OUTLIER, {**ZEN4_OUTLIER, "mlp": ZEN4_MLP_AGAIN})
    monkeypatch.setattr(gemm_plan, "measure", measure)
    plan = plan_for(BIG, torch.bfloat16)
    assert measure.calls == [("qkv", "o", "mlp", "lm_head"), ("mlp",)]  # type: ignore[attr-defined]
    for role in gemm_plan.LAYER_ROLES:
        assert plan.paths[role][0] == "kvserve_tiled" and storage_of(plan.paths[role][1]) == "loaded"
    assert plan.timings_us["mlp"][1]["kvserve_tiled"] == 1460 and plan.timings_us["mlp"][0]["onednn_packed"] == 872
    assert plan_for(BIG, torch.bfloat16).paths == plan.paths  # from the cache, no third measurement
    assert len(measure.calls) == 2  # type: ignore[attr-defined]


def test_a_real_trade_survives_the_second_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the loaded tensor really is 1.47x slower in a band (the AMX Xeon's recorded MLP, the
    same both times), the second measurement changes nothing; a plan that keeps decode on the
    loaded tensor is not measured again."""
    _all_paths(monkeypatch)
    measure = _measure_in_turn(AMX_XEON)
    monkeypatch.setattr(gemm_plan, "measure", measure)
    plan = plan_for(BIG, torch.bfloat16)
    assert plan.paths["mlp"] == ("onednn_packed",) * 5
    assert measure.calls[0] == ("qkv", "o", "mlp", "lm_head") and len(measure.calls) == 2  # type: ignore[attr-defined]
    assert "mlp" in measure.calls[1]  # type: ignore[attr-defined]
    monkeypatch.setenv("KVSERVE_RETUNE_KERNELS", "1")
    tiles = _measure_in_turn(AMX_TILES)
    monkeypatch.setattr(gemm_plan, "measure", tiles)
    plan_for(BIG, torch.bfloat16)
    assert tiles.calls == [("qkv", "o", "mlp", "lm_head")]  # type: ignore[attr-defined]
