"""``kvserve eval kv``: quality of lossy KV codecs on the shipped model's held-out text."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

eval_app = typer.Typer(help="Quality evaluations.", no_args_is_help=True)


@eval_app.command("kv")
def kv(
    model: Annotated[str | None, typer.Option(help="Checkpoint folder (default: the embedded model).")] = None,
    codecs: Annotated[str, typer.Option(help="Codecs to compare with full-precision KV, ';'-separated "
                                             "(a mixed spec is 'k:int8,v:int4').")] = "fp8;int8;int4;k:int8,v:int4",
    texts: Annotated[int, typer.Option(help="Held-out texts to score.")] = 8,
    max_tokens: Annotated[int, typer.Option(help="Tokens scored per text (its first ones).")] = 512,
    chunk: Annotated[int, typer.Option(help="Tokens fed per step (1 = as in decoding).")] = 1,
    greedy_prompts: Annotated[int, typer.Option(help="Prompts for the greedy-agreement test.")] = 4,
    greedy_tokens: Annotated[int, typer.Option(help="Tokens generated per greedy prompt.")] = 256,
    min_tokens: Annotated[int, typer.Option(help="kv_quant_min_tokens (0: quantize from the start).")] = 0,
    sink_tokens: Annotated[int, typer.Option(help="kv_quant_sink_tokens for int4.")] = 4,
    group_size: Annotated[int | None, typer.Option(help="int4 key group (default min(32, block size)).")] = None,
    block_size: Annotated[int, typer.Option()] = 16,
    dtype: Annotated[str, typer.Option(help="Model dtype (auto: the checkpoint's).")] = "auto",
    threads: Annotated[int | None, typer.Option(help="torch threads (default: one per physical core).")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the report as JSON here.")] = None,
    evict: Annotated[str | None, typer.Option(help="Eviction curve instead of codecs: policies, ','-separated "
                                                   "(sinks, snapkv, h2o; docs/eviction.md).")] = None,
    ratios: Annotated[str, typer.Option(help="Fractions of KV removed, ','-separated.")] = "0.25,0.5,0.75,0.875",
    context_tokens: Annotated[int, typer.Option(help="Eviction: the context a policy compresses; the "
                                                     "rest of each text is scored.")] = 384,
    png: Annotated[Path | None, typer.Option(help="Eviction: draw the KL curve here.")] = None,
) -> None:
    """Perplexity, ΔPPL, KL, top-1 and greedy agreement and bytes/token per KV codec; with
    ``--evict``, KL, ΔPPL and tokens/GiB per eviction policy and ratio."""
    from kvserve.engine.llm import resolve_model_path
    from kvserve.eval.kv_quality import EvalConfig, format_table, run_eval

    names = tuple(c.strip() for c in codecs.split(";") if c.strip())
    cfg = EvalConfig(model=resolve_model_path(model), codecs=names, texts=texts, max_tokens=max_tokens, chunk=chunk,
                     greedy_prompts=greedy_prompts, greedy_tokens=greedy_tokens, min_tokens=min_tokens,
                     sink_tokens=sink_tokens, group_size=group_size, block_size=block_size, dtype=dtype,
                     num_threads=threads)
    if evict is not None:
        doc = _evict(cfg, evict, ratios, context_tokens, chunk, png)
    else:
        report = run_eval(cfg, log=lambda s: print(s, file=sys.stderr))
        print(format_table(report))
        doc = report.to_json()
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(doc, indent=1))
        print(f"wrote {json_out}", file=sys.stderr)
    else:
        print(json.dumps(doc))


def _evict(cfg: object, evict: str, ratios: str, context_tokens: int, chunk: int, png: Path | None) -> dict:  # type: ignore[type-arg]
    from kvserve.eval.evict_curve import curve, plot
    from kvserve.eval.kv_quality import heldout_tokens, make_engine

    engine = make_engine(cfg, "auto")  # type: ignore[arg-type]
    seqs = [s for s in heldout_tokens(engine.tokenizer, cfg.texts, cfg.max_tokens)  # type: ignore[attr-defined]
            if len(s) > context_tokens + 1]
    doc = curve(engine, seqs, [p.strip() for p in evict.split(",") if p.strip()],
                [float(r) for r in ratios.split(",") if r.strip()], context_tokens, max(chunk, 8))
    if png is not None:
        png.parent.mkdir(parents=True, exist_ok=True)
        plot(doc, str(png))
    return doc


def register(app: typer.Typer) -> None:
    app.add_typer(eval_app, name="eval")
