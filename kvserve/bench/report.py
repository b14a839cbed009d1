"""Tables and the plot for the turn experiment."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvserve.bench.turns import per_turn


def turns_table(doc: dict, every: int = 1) -> Table:
    """One row per turn (every ``every``-th, plus turn 1 and the last); a cell per mode holds
    ``TTFT s | ms per token | prompt tokens from cache``."""
    modes = list(doc["modes"])
    table = Table(title="per turn: TTFT s | ms/token | cached prompt tokens (median over conversations)")
    table.add_column("turn", justify="right")
    for m in modes:
        table.add_column(m, justify="right")
    series = {m: (per_turn(doc["modes"][m], "ttft_s"), per_turn(doc["modes"][m], "ms_per_token"),
                  per_turn(doc["modes"][m], "cached_tokens")) for m in modes}
    turns = sorted(next(iter(series.values()))[0])
    for t in turns:
        if t != 1 and t != turns[-1] and t % every:
            continue
        row = [str(t)]
        for m in modes:
            ttft, mspt, cached = series[m]
            row.append(f"{ttft[t]:.3f} | {mspt[t]:.1f} | {cached[t]:.0f}")
        table.add_row(*row)
    return table


def summary_table(doc: dict) -> Table:
    table = Table(title="Turn 1 against the late turn")
    for col in ("mode", "turn", "TTFT@1", "TTFT@late", "×", "ms/tok@1", "ms/tok@late", "×", "vs none",
                "cached/ideal"):
        table.add_column(col, justify="right")
    for mode, s in doc["summary"].items():
        table.add_row(mode, str(s["late_turn"]), f"{s['ttft_turn1_s']:.3f}", f"{s['ttft_late_s']:.3f}",
                      f"{s['ttft_ratio']:.2f}×", f"{s['ms_per_token_turn1']:.1f}", f"{s['ms_per_token_late']:.1f}",
                      f"{s['ms_per_token_ratio']:.2f}×", f"{s.get('speedup_vs_none_late', float('nan')):.1f}×",
                      f"{100 * s['cached_fraction_of_ideal']:.1f}%")
    return table


def print_report(doc: dict, console: Console | None = None) -> None:
    console = console or Console()
    turns = doc["config"]["turns"]
    cpu = doc.get("cpu")
    if cpu:
        console.print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: {doc.get('threads')}")
    console.print(turns_table(doc, every=max(1, turns // 10)))
    console.print(summary_table(doc))
    tiers = doc["summary"].get("session-tiers", {})
    for key, what in (("tiers_over_big", "TTFT with tiers ÷ a pool that holds everything"),
                      ("recompute_over_tiers", "TTFT recomputing ÷ with tiers")):
        if key + "_per_turn" in tiers:
            per = ", ".join(f"t{t}: {r:.2f}" for t, r in tiers[key + "_per_turn"].items())
            console.print(f"{what}: median {tiers[key + '_median']:.2f} ({per})")
    r = doc.get("restart")
    if r:
        console.print(f"restart on the same disk directory: engine start {r['engine_start_s']:.2f} s, disk index of "
                      f"{r['disk_blocks']} blocks rebuilt in {r['index_rebuild_s'] * 1e3:.1f} ms "
                      f"({r['rebuild_s_per_10k_blocks'] * 1e3:.0f} ms per 10k blocks); first token "
                      f"{r['first_token_after_restart_s']:.2f} s after the restart began; next turn's TTFT median "
                      f"{r['next_turn_ttft_median_s']:.3f} s with {100 * r['next_turn_cached_fraction']:.0f}% of the "
                      "history from the tiers")


def plot_turns(doc: dict, path: Path) -> Path:
    """PNG: TTFT, ms per output token and KV memory against turn, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for mode, mdoc in doc["modes"].items():
        ttft = per_turn(mdoc, "ttft_s")
        mspt = per_turn(mdoc, "ms_per_token")
        kv = per_turn(mdoc, "kv_bytes")
        axes[0].plot(list(ttft), list(ttft.values()), label=mode, marker=".")
        axes[1].plot(list(mspt), list(mspt.values()), label=mode, marker=".")
        axes[2].plot(list(kv), [b / 2**20 for b in kv.values()], label=mode, marker=".")
    for ax, title, unit in zip(axes, ("time to first token", "decode", "KV cache held"), ("s", "ms / token", "MiB")):
        ax.set_title(title)
        ax.set_xlabel("turn")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
    axes[0].legend()
    cfg = doc["config"]
    fig.suptitle(f"{Path(cfg['model']).name}: {cfg['turns']} turns, +{cfg['user_tokens']} user / "
                 f"{cfg['new_tokens']} generated tokens per turn, {cfg['conversations']} conversation(s)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
