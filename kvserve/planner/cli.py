"""``kvserve plan``: size a deployment before launching it.

Options are read as text and parsed by :mod:`kvserve.planner.inputs`, so every bad value is one
line (``kvserve: error: …``, exit 2, from :func:`kvserve.cli.main`), the same on the command line
as inside ``--compare``.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from rich.console import Console

from kvserve.config_file import write_config_file
from kvserve.planner.compare import compare_section, compare_to_dict, run_compare
from kvserve.planner.hardware import cpu_measurements
from kvserve.planner.inputs import PlanRequest
from kvserve.planner.kv_only import has_hardware, kv_only
from kvserve.planner.plan import build_plan
from kvserve.planner.presets import hardware_presets, model_presets
from kvserve.planner.render import print_rich, to_markdown
from kvserve.planner.report import plan_to_dict
from kvserve.planner.scenarios import SCENARIOS
from kvserve.planner.sections import Section, sections
from kvserve.planner.write_config import engine_config_for

Opt = typer.Option


def _listing() -> list[Section]:
    models = [
        [
            k,
            v["architectures"][0],
            f"{v['parameters']['total']:,}",
            f"{v['kv_cache']['bytes_per_token_bf16']:,}",
        ]
        for k, v in model_presets().items()
    ]
    hw = [
        [k, v["name"], f"{v['memory_gib']}", f"{v['memory_bandwidth_gb_s']:,}"]
        for k, v in hardware_presets().items()
    ]
    sc = [[s.name, s.summary] for s in SCENARIOS.values()]
    return [
        Section("Model presets (--model)", ("name", "architecture", "parameters", "KV B/token bf16"), models),
        Section("Hardware presets (--hardware, or cpu)", ("name", "device", "label GB", "GB/s"), hw),
        Section("Scenarios (--scenario)", ("name", "for"), sc),
    ]


def _emit(secs: list[Section], data: dict[str, Any], as_json: bool, as_markdown: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    elif as_markdown:
        sys.stdout.write(to_markdown(secs))
    else:
        print_rich(secs, Console(width=max(Console().width, 120)))


def plan_command(
    model: Annotated[
        str | None,
        Opt("--model", "-m", metavar="PATH|PRESET", help="config.json, checkpoint folder or preset name"),
    ] = None,
    hardware: Annotated[
        str | None,
        Opt(
            "--hardware", "--gpu", metavar="PRESET|cpu", help="accelerator preset (h100, a100-40gb …) or cpu"
        ),
    ] = None,
    memory: Annotated[
        str | None, Opt(metavar="SIZE", help="device memory by hand, e.g. 80GiB (overrides the preset)")
    ] = None,
    bandwidth: Annotated[
        str | None, Opt(metavar="GB/S", help="memory bandwidth, e.g. 3350 (GB/s) or 3.35TB/s")
    ] = None,
    tflops: Annotated[str | None, Opt(metavar="TFLOPS", help="dense TFLOPS for the prefill estimate")] = None,
    dtype: Annotated[
        str | None,
        Opt(metavar="DTYPE", help="weight dtype: auto (checkpoint's), bf16, fp16, fp32, fp8, int8, int4"),
    ] = None,
    kv_dtype: Annotated[
        str | None, Opt(metavar="DTYPE", help="KV dtype: auto, bf16, fp16, fp8, int8, int4")
    ] = None,
    kv_calibration: Annotated[
        str | None, Opt(metavar="FILE", help="a per-layer KV calibration file (the engine's --kv-calibration)")
    ] = None,
    kv_quality_budget: Annotated[
        str | None, Opt(metavar="kl=X", help="with --kv-dtype auto: calibrate the checkpoint per layer for this KL")
    ] = None,
    block_size: Annotated[
        str | None, Opt(metavar="N", help="tokens per KV block (power of two; default 16)")
    ] = None,
    max_model_len: Annotated[
        str | None, Opt(metavar="TOKENS", help="longest sequence (prompt + output), e.g. 32768 or 32K")
    ] = None,
    max_num_seqs: Annotated[str | None, Opt(metavar="N", help="most sequences running at once")] = None,
    max_num_batched_tokens: Annotated[
        str | None, Opt(metavar="TOKENS", help="tokens per scheduler step")
    ] = None,
    concurrency: Annotated[
        str | None, Opt(metavar="N", help="concurrent sequences to plan for (default max_num_seqs)")
    ] = None,
    utilization: Annotated[
        str | None,
        Opt(metavar="FRACTION", help="share of device memory the engine may use, (0, 1]; default 0.9"),
    ] = None,
    reserve: Annotated[
        str | None,
        Opt(metavar="FRACTION|SIZE", help="activations/runtime: 0.2 or 20% of usable×utilization, or 4GiB"),
    ] = None,
    tp: Annotated[str | None, Opt(metavar="N", help="tensor-parallel degree (GPUs)")] = None,
    kv_cache_memory: Annotated[
        str | None, Opt(metavar="SIZE", help="fixed KV budget per GPU, as the engine takes it (4GiB)")
    ] = None,
    weights_memory: Annotated[
        str | None, Opt(metavar="SIZE", help="weights size by hand (e.g. 16GiB) instead of params × dtype")
    ] = None,
    sliding_window: Annotated[
        str | None, Opt(metavar="TOKENS|none", help="cap every layer's KV at N tokens (lossy), or none")
    ] = None,
    prompt_tokens: Annotated[str | None, Opt(metavar="TOKENS", help="typical request prompt length")] = None,
    output_tokens: Annotated[str | None, Opt(metavar="TOKENS", help="typical request output length")] = None,
    price_per_hour: Annotated[
        str | None, Opt(metavar="USD", help="price of one GPU-hour, for $/M tokens and KV rent")
    ] = None,
    scenario: Annotated[
        str | None, Opt(metavar="NAME", help="short-chat | long-doc-qa | multi-turn | high-concurrency")
    ] = None,
    price_input: Annotated[
        str | None, Opt(metavar="USD", help="per million computed prompt tokens (as kvserve serve --price-input)")
    ] = None,
    price_cached_input: Annotated[
        str | None, Opt(metavar="USD", help="per million prompt tokens served from cache")
    ] = None,
    price_output: Annotated[str | None, Opt(metavar="USD", help="per million generated tokens")] = None,
    cached_fraction: Annotated[
        str | None, Opt(metavar="FRACTION", help="share of a typical prompt served from cache, [0, 1)")
    ] = None,
    compare: Annotated[
        str | None, Opt(metavar="KEY=A,B,..", help="what-if: KEY=a,b,c (e.g. kv_dtype=bf16,int8,int4)")
    ] = None,
    as_json: Annotated[bool, Opt("--json", help="print JSON")] = False,
    as_markdown: Annotated[bool, Opt("--markdown", help="print markdown tables")] = False,
    plot: Annotated[str | None, Opt(metavar="DIR", help="write PNG plots into this folder")] = None,
    write_config: Annotated[
        str | None, Opt(metavar="FILE", help="write an engine config file (JSON) for this plan")
    ] = None,
    check: Annotated[
        bool, Opt("--check", help="exit 1 when max_num_seqs × max_model_len does not fit")
    ] = False,
    remeasure: Annotated[
        bool, Opt("--remeasure", help="with --hardware cpu: measure this host again, replacing the cache")
    ] = False,
    list_presets: Annotated[
        bool, Opt("--list", help="list model and hardware presets and scenarios")
    ] = False,
) -> None:
    """Plan KV before launch: bytes per token, the memory ledger, concurrency, speed and cost bounds."""
    if as_json and as_markdown:
        raise ValueError("choose one of --json and --markdown")
    if list_presets:
        _emit(
            _listing(),
            {
                "models": list(model_presets()),
                "hardware": list(hardware_presets()),
                "scenarios": list(SCENARIOS),
            },
            as_json,
            as_markdown,
        )
        return
    if model is None:
        raise ValueError("--model is required (a config.json, a checkpoint folder or a preset; see --list)")
    req = PlanRequest(
        model=model,
        hardware=hardware,
        memory=memory,
        bandwidth=bandwidth,
        tflops=tflops,
        dtype=dtype,
        kv_dtype=kv_dtype,
        kv_calibration=kv_calibration,
        kv_quality_budget=kv_quality_budget,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        concurrency=concurrency,
        utilization=utilization,
        reserve=reserve,
        tp=tp,
        kv_cache_memory=kv_cache_memory,
        weights_memory=weights_memory,
        sliding_window=sliding_window,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        price_per_hour=price_per_hour,
        scenario=scenario,
        price_input=price_input,
        price_cached_input=price_cached_input,
        price_output=price_output,
        cached_fraction=cached_fraction,
    )
    if remeasure:
        cpu_measurements(refresh=True)
    if compare is not None:
        if plot or write_config:
            raise ValueError("--plot and --write-config work on a single plan, not with --compare")
        key, variants = run_compare(req, compare)
        _emit([compare_section(key, variants)], compare_to_dict(key, variants), as_json, as_markdown)
        return
    if not has_hardware(req) and not (write_config or plot or check):
        _emit(*kv_only(req), as_json, as_markdown)  # what needs no hardware, instead of an error
        return
    plan = build_plan(req)
    config = engine_config_for(plan) if write_config else None  # refuse before printing anything
    _emit(sections(plan), plan_to_dict(plan), as_json, as_markdown)
    if plot:
        from kvserve.planner.plot import write_plots

        for p in write_plots(plan, plot):
            print(f"wrote {p}", file=sys.stderr)
    if write_config and config is not None:
        print(f"wrote {write_config_file(write_config, *config)}", file=sys.stderr)
    if check and not plan.fit.fits:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``kvserve plan`` to ``app``."""
    app.command("plan")(plan_command)
