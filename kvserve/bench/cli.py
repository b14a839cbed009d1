"""``kvserve bench turns`` and ``kvserve demo``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

bench_app = typer.Typer(help="Benchmarks.", no_args_is_help=True)


def _run_with_progress(cfg, console: Console, out: Path) -> dict:
    """Run with a progress bar; ``out/turns.json`` is rewritten after every mode."""
    from kvserve.bench.turns import run

    out.mkdir(parents=True, exist_ok=True)

    def save(doc: dict) -> None:
        (out / "turns.json").write_text(json.dumps(doc, indent=1))

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("turn {task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        tasks = {m: progress.add_task(m, total=cfg.turns) for m in cfg.modes}
        return run(cfg, lambda mode, t: progress.update(tasks[mode], completed=t), save)


@bench_app.command("turns")
def turns(
    model: Annotated[str | None, typer.Option(help="Checkpoint folder (default: the embedded model).")] = None,
    modes: Annotated[str, typer.Option(help="Comma-separated: none, prefix, session, session-tiers, session-big, "
                                             "hf-recompute, hf-reuse.")]
    = "none,prefix,session,hf-recompute,hf-reuse",
    turns: Annotated[int, typer.Option(help="Turns per conversation.")] = 40,
    user_tokens: Annotated[int, typer.Option(help="New user tokens per turn.")] = 64,
    new_tokens: Annotated[int, typer.Option(help="Generated tokens per turn.")] = 32,
    conversations: Annotated[int, typer.Option(help="Interleave K conversations round-robin.")] = 1,
    dtype: Annotated[str, typer.Option()] = "auto",
    kv_cache_memory: Annotated[str, typer.Option()] = "1GiB",
    kv_host_memory: Annotated[str, typer.Option(help="session-tiers: the host tier's size.")] = "4GiB",
    kv_disk_dir: Annotated[str | None, typer.Option(
        help="session-tiers: the disk tier (default: a temporary directory).")] = None,
    big_kv_cache_memory: Annotated[str, typer.Option(help="session-big: a pool that holds everything.")] = "8GiB",
    attention_backend: Annotated[str, typer.Option(help="auto, torch_sdpa or native.")] = "auto",
    out: Annotated[Path, typer.Option(help="Folder for turns.json and turns.png.")] = Path("bench-out"),
) -> None:
    """The turn-by-turn latency experiment: TTFT, ms/token and KV held against turn, per mode."""
    from kvserve.bench.report import plot_turns, print_report
    from kvserve.bench.turns import TurnsConfig
    from kvserve.engine.llm import resolve_model_path

    cfg = TurnsConfig(model=resolve_model_path(model), modes=tuple(m.strip() for m in modes.split(",") if m.strip()),
                      turns=turns, user_tokens=user_tokens, new_tokens=new_tokens, conversations=conversations,
                      dtype=dtype, kv_cache_memory=kv_cache_memory, kv_host_memory=kv_host_memory,
                      kv_disk_dir=kv_disk_dir, big_kv_cache_memory=big_kv_cache_memory,
                      attention_backend=attention_backend)
    console = Console()
    doc = _run_with_progress(cfg, console, out)
    plot_turns(doc, out / "turns.png")
    print_report(doc, console)
    console.print(f"wrote {out / 'turns.json'} and {out / 'turns.png'}")


def demo(
    turns: Annotated[int, typer.Option(help="Turns of the conversation.")] = 24,
    out: Annotated[Path, typer.Option(help="Where to write the plot and JSON.")] = Path("kvserve-demo"),
) -> None:
    """Five minutes with kvserve: watch a chat get slower every turn, then not."""
    from kvserve.bench.report import plot_turns, summary_table
    from kvserve.bench.turns import TurnsConfig
    from kvserve.engine.llm import resolve_model_path

    console = Console()
    console.rule("[bold]kvserve demo: why chats get slower every turn")
    console.print("A conversation grows by 64 tokens a turn and the model answers with 32. Three ways to serve it:\n"
                  "  [bold]none[/]     resend and recompute the whole history every turn\n"
                  "  [bold]prefix[/]   resend it, but reuse cached KV blocks of the history\n"
                  "  [bold]session[/]  send only the new message; the conversation's KV stays pinned\n")
    cfg = TurnsConfig(model=resolve_model_path(None), modes=("none", "prefix", "session"), turns=turns,
                      kv_cache_memory="256MiB")
    doc = _run_with_progress(cfg, console, out)
    png = plot_turns(doc, out / "turns.png")
    console.print(summary_table(doc))
    s = doc["summary"]
    late = s["none"]["late_turn"]
    console.print(
        f"\nAt turn {late}, recomputing the history took {s['none']['ttft_late_s'] * 1e3:.0f} ms to the first token, "
        f"{s['none']['ttft_ratio']:.1f}× turn 1: the prompt grows every turn, so the work does. With the prefix "
        f"cache the history's KV is found again ({100 * s['prefix']['cached_fraction_of_ideal']:.0f}% of it) and "
        f"with a session it never left: TTFT stays at {s['session']['ttft_late_s'] * 1e3:.0f} ms "
        f"({s['session']['speedup_vs_none_late']:.1f}× faster than recompute). What still grows is the KV held "
        f"and read per token, which is what `kvserve plan` sizes. Plot: {png}"
    )


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
    app.command("demo")(demo)
