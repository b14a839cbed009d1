"""``--plot DIR``: two PNGs (matplotlib, Agg backend, no display needed).

- ``kv_per_sequence.png``: KV bytes one sequence holds against context, one line per KV dtype.
- ``max_concurrency.png``: how many sequences fit the KV budget against context, per KV dtype.
"""

from __future__ import annotations

from pathlib import Path

from kvserve.kv.layout import KV_DTYPES
from kvserve.planner.capacity import max_sequences
from kvserve.planner.kv_model import build_kv_model
from kvserve.planner.plan import Plan
from kvserve.planner.units import GIB

PLOT_DTYPES = ("bfloat16", "fp8", "int8", "int4")


def _contexts(max_len: int) -> list[int]:
    out, t = [], 256
    while t < max(max_len, 131072):
        out.append(t)
        t *= 2
    out.append(max(max_len, 131072))
    return out


def write_plots(plan: Plan, out_dir: str | Path) -> list[Path]:
    """Write both PNGs into ``out_dir`` (created if missing); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s = plan.settings
    contexts = _contexts(s.max_model_len)
    dtypes = [d for d in PLOT_DTYPES if d in KV_DTYPES]
    if s.kv_dtype not in dtypes:
        dtypes.insert(0, s.kv_dtype)
    models = {d: build_kv_model(plan.spec, d, s.tp, s.sliding_window, s.block_size) for d in dtypes}
    title = f"{plan.spec.name}" + (f", tp {s.tp}" if s.tp > 1 else "")
    if s.sliding_window is not None:
        title += f", KV window {s.sliding_window:,}"
    style = {"fp8": "--"}  # fp8 and int8 cost the same bytes: dash one so both show

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for d, kv in models.items():
        ax.plot(
            contexts,
            [kv.sequence_bytes(t) * s.tp / GIB for t in contexts],
            marker="o",
            label=d,
            linestyle=style.get(d, "-"),
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="context (tokens)",
        ylabel="KV per sequence (GiB)",
        title=f"KV per sequence: {title}",
    )
    ax.set_xticks(contexts, [f"{t // 1024}K" if t >= 1024 else str(t) for t in contexts], rotation=45)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    p1 = out / "kv_per_sequence.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    budget = plan.ledger.kv_budget_bytes
    for d, kv in models.items():
        counts = [max_sequences(budget, kv, t, s.block_size) for t in contexts]
        ax.plot(
            contexts,
            [n if n > 0 else float("nan") for n in counts],
            marker="o",
            label=d,  # 0: no point
            linestyle=style.get(d, "-"),
        )
    ax.axhline(s.max_num_seqs, color="grey", linestyle="--", label=f"max_num_seqs {s.max_num_seqs}")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="context (tokens)",
        ylabel="max concurrent sequences",
        title=f"Concurrency in a {budget / GIB:.1f} GiB KV budget: {title}",
    )
    ax.set_xticks(contexts, [f"{t // 1024}K" if t >= 1024 else str(t) for t in contexts], rotation=45)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    p2 = out / "max_concurrency.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]
