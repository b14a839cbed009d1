"""``kvserve plan`` with a per-layer KV map: from a calibration file, or ``--kv-dtype layers:…``;
bad inputs are one line and exit 2. (Calibrating for a budget is tested in tests/quant.)"""

from __future__ import annotations

from pathlib import Path

from kvserve.kv.calibration import Calibration
from kvserve.kv.codec_names import parse_layer_codecs
from kvserve.kv.layout import kv_block_bytes

from .conftest import plan_json

MAP = "layers:int8/k:int8,v:int4"


def test_plan_takes_the_calibration_map(cli, tiny_ckpt: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    file = tmp_path / "cal.json"
    Calibration.make(parse_layer_codecs(MAP), budget_kl=1e-3, joint_kl=5e-4, summed_kl=6e-4, bytes_per_token=0,
                     full_bytes_per_token=0, model="x", model_id="", text={}, settings={}).save(file)
    args = ("--model", str(tiny_ckpt), "--kv-cache-memory", "1GiB", "--block-size", "16")
    got = plan_json(cli, *args, "--kv-calibration", str(file))
    want = plan_json(cli, *args, "--kv-dtype", MAP)
    assert got["kv_dtype"] == want["kv_dtype"] == MAP
    per_token = kv_block_bytes(2, 2, 16, MAP, 16) // 16
    assert got["bytes_per_token"] == want["bytes_per_token"] == per_token
    assert "1 × int8 + 1 × k:int8,v:int4" in got.get("kv_formula", got.get("formula", ""))
    bf16 = plan_json(cli, *args, "--kv-dtype", "bf16")
    assert got["bytes_per_token"] < bf16["bytes_per_token"]
    if "settings" in got:
        assert got["settings"]["kv_dtype"]["source"].startswith("calibration")
    table = cli(*args, "--kv-calibration", str(file))
    assert table.code == 0 and MAP in table.out


def test_plan_refuses_what_it_cannot_use(cli, tiny_ckpt: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    file = tmp_path / "cal.json"
    Calibration.make(parse_layer_codecs("layers:int8*3/int4"), budget_kl=1e-3, joint_kl=0, summed_kl=0,
                     bytes_per_token=0, full_bytes_per_token=0, model="x", model_id="", text={}, settings={}).save(file)
    for args, why in ((("--kv-calibration", str(file)), "has 4 layers but the model has 2"),
                      (("--kv-quality-budget", "kl=x"), "cannot read kv_quality_budget"),
                      (("--kv-quality-budget", "kl=1e-3"), "give --model a checkpoint folder"),
                      (("--kv-dtype", "int8", "--kv-quality-budget", "kl=1e-3"), "needs --kv-dtype auto"),
                      (("--kv-dtype", "layers:int8*2/int4"), "names 3 layers but the model has 2")):
        r = cli("--model", str(tiny_ckpt), *args)
        assert r.code == 2, (args, r.out)
        assert why in r.err and r.err.strip().count("\n") == 0, r.err
