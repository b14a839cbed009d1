"""``kvserve eval kv``: quality of lossy KV codecs on the shipped model's held-out text."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from kvserve.eval.kv_quality import EvalConfig

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
    png: Annotated[Path | None, typer.Option(help="Eviction: draw the KL and retrieval curves here.")] = None,
    kv_cache_dtype: Annotated[str, typer.Option(help="Eviction: KV codecs each policy runs under, ';'-separated "
                                                     "(auto = full precision; 'int8', 'fp8;int8', ...).")] = "auto",
    retrieval_model: Annotated[str | None, typer.Option(help="Eviction: the retrieval model's folder (default: "
                                                             "the shipped kvserve-tiny-retrieval; 'none': skip).")] = None,
    retrieval_examples: Annotated[int, typer.Option(help="Eviction: held-out retrieval prompts answered.")] = 64,
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
        try:
            plan = _EvictPlan.parse(evict, ratios, kv_cache_dtype, retrieval_model, retrieval_examples)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise typer.Exit(2) from None
        doc = _evict(cfg, plan, context_tokens, chunk, png)
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


@dataclass(frozen=True)
class _EvictPlan:
    policies: tuple[str, ...]
    ratios: tuple[float, ...]
    codecs: tuple[str, ...]
    retrieval: Path | None
    retrieval_examples: int

    @classmethod
    def parse(cls, evict: str, ratios: str, codecs: str, retrieval: str | None, n: int) -> _EvictPlan:
        from kvserve.eval.evict_curve import POLICIES
        from kvserve.eval.retrieval import shipped_retrieval_model

        policies = tuple(p.strip() for p in evict.split(",") if p.strip())
        bad = [p for p in policies if p not in POLICIES]
        if not policies or bad:
            raise ValueError(f"unknown eviction policy {', '.join(bad) or '(none given)'}; choose from "
                             f"{', '.join(POLICIES)}")
        try:
            rs = tuple(float(r) for r in ratios.split(",") if r.strip())
        except ValueError:
            raise ValueError(f"--ratios must be numbers in [0, 1), got {ratios!r}") from None
        if not rs or any(not 0.0 <= r < 1.0 for r in rs):
            raise ValueError(f"--ratios must be numbers in [0, 1), got {ratios!r}")
        if n <= 0:
            raise ValueError("--retrieval-examples must be > 0")
        path = shipped_retrieval_model() if retrieval is None else None if retrieval == "none" else Path(retrieval)
        if path is not None and not (path / "heldout.jsonl").is_file():
            raise ValueError(f"{path} is not a retrieval model folder (it has no heldout.jsonl)")
        names = tuple(c.strip() for c in codecs.split(";") if c.strip()) or ("auto",)
        return cls(policies, rs, names, path, n)


def _evict(cfg: EvalConfig, plan: _EvictPlan, context_tokens: int, chunk: int, png: Path | None) -> dict:  # type: ignore[type-arg]
    from kvserve.eval.evict_curve import Target, curve, plot
    from kvserve.eval.kv_quality import heldout_tokens, make_engine
    from kvserve.eval.retrieval import RetrievalSet, load_heldout

    engine = make_engine(cfg, "auto")
    seqs = [s for s in heldout_tokens(engine.tokenizer, cfg.texts, cfg.max_tokens) if len(s) > context_tokens + 1]
    examples = tuple(load_heldout(plan.retrieval, plan.retrieval_examples)) if plan.retrieval else ()
    rcfg = replace(cfg, model=str(plan.retrieval), dtype="auto", texts=len(examples), greedy_prompts=0,
                   max_tokens=len(examples[0].prompt) + 2) if examples else None

    def target(codec: str, chat: object = None) -> Target:
        rs = RetrievalSet(make_engine(rcfg, codec), examples) if rcfg is not None else None
        return Target(chat or make_engine(cfg, codec), rs)  # type: ignore[arg-type]

    ref = target("auto", engine)
    targets = [ref if c == "auto" else target(c) for c in plan.codecs]
    doc = curve(ref, seqs, plan.policies, plan.ratios, context_tokens, max(chunk, 8), targets,
                log=lambda s: print(s, file=sys.stderr, flush=True))
    doc["command"] = "kvserve eval kv " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["eval", "kv"] else sys.argv[1:])
    doc["machine"] = _machine()
    if png is not None:
        png.parent.mkdir(parents=True, exist_ok=True)
        plot(doc, str(png))
    return doc


def _machine() -> object:
    from kvserve.bench.machine import cpu_info

    return cpu_info()


def register(app: typer.Typer) -> None:
    app.add_typer(eval_app, name="eval")
