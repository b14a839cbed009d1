"""``kvserve generate`` (one completion) and ``kvserve chat`` (interactive, streaming)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Annotated

import typer

ModelOpt = Annotated[str | None, typer.Option("--model", help="Checkpoint folder (default: the embedded model).")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="Weights dtype: auto, bfloat16, float16, float32.")]
KVMemOpt = Annotated[str | None, typer.Option("--kv-cache-memory", help="KV pool size, e.g. 1GiB.")]
MaxTokOpt = Annotated[int, typer.Option("--max-tokens", help="Most tokens to generate.")]
TempOpt = Annotated[float, typer.Option("--temperature", help="0 = greedy.")]
TopPOpt = Annotated[float, typer.Option("--top-p")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="0 disables.")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Per-request sampling seed.")]
MaxLenOpt = Annotated[int | None, typer.Option("--max-model-len")]


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")


def generate(
    prompt: Annotated[str, typer.Option("--prompt", help="Prompt text (raw completion, no chat template).")],
    model: ModelOpt = None,
    dtype: DtypeOpt = "auto",
    kv_cache_memory: KVMemOpt = "512MiB",
    max_tokens: MaxTokOpt = 64,
    temperature: TempOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: SeedOpt = None,
    max_model_len: MaxLenOpt = None,
    n: Annotated[int, typer.Option("--n", help="Number of samples.")] = 1,
    verbose: Annotated[bool, typer.Option("--verbose/--quiet", help="Log the KV allocation.")] = True,
    retune_kernels: Annotated[bool, typer.Option(
        "--retune-kernels", help="Measure the GEMM paths again (also KVSERVE_RETUNE_KERNELS=1).")] = False,
    tensor_parallel_size: Annotated[int, typer.Option(
        "--tensor-parallel-size", help="Split the model over T worker processes.")] = 1,
    gemm_extra_memory: Annotated[str | None, typer.Option(
        "--gemm-extra-memory", help="Memory for second copies of weights the GEMM plan may keep (e.g. 1GiB; default 64MiB): on "
        "a CPU where the fastest path for one row and the one for many rows need different layouts, a copy "
        "for each can make decode faster (AMX CPUs no longer need one: the tiled kernel runs on AMX tiles "
        "over the loaded weight) (also KVSERVE_GEMM_EXTRA_MIB).")] = None,
) -> None:
    """Complete one prompt and print the text."""
    from kvserve.engine.llm import LLM
    from kvserve.sampling_params import SamplingParams

    _setup_logging(verbose)
    if retune_kernels:
        os.environ["KVSERVE_RETUNE_KERNELS"] = "1"
    if gemm_extra_memory is not None:
        from kvserve.model.gemm_plan import set_extra_budget

        set_extra_budget(gemm_extra_memory)
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed)
    llm = LLM(model, dtype=dtype, kv_cache_memory=kv_cache_memory, max_model_len=max_model_len,
              tensor_parallel_size=tensor_parallel_size)
    out = llm.generate([prompt], params)[0]
    llm.shutdown()
    for c in out.outputs:
        if n > 1:
            typer.echo(f"--- sample {c.index} ({c.finish_reason}) ---")
        typer.echo(prompt + c.text)


def chat(
    model: ModelOpt = None,
    dtype: DtypeOpt = "auto",
    kv_cache_memory: KVMemOpt = "512MiB",
    max_tokens: MaxTokOpt = 256,
    temperature: TempOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: SeedOpt = None,
    system: Annotated[str | None, typer.Option("--system", help="System prompt.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose/--quiet")] = False,
) -> None:
    """Interactive chat with streaming output. Empty line or /exit (or EOF) quits."""
    from kvserve.engine.llm import LLM
    from kvserve.sampling_params import SamplingParams

    _setup_logging(verbose)
    llm = LLM(model, dtype=dtype, kv_cache_memory=kv_cache_memory)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed)
    first: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            typer.echo(">>> ", nl=False)
        line = sys.stdin.readline()
        if not line or line.strip() in ("", "/exit", "/quit"):
            break
        turn = first + [{"role": "user", "content": line.rstrip("\n")}]
        first = []
        # One session: each turn prefills only its new tokens; the history's KV stays pinned.
        for piece in llm.stream_chat(turn, params, session_id="cli"):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        out = llm.last_output
        if verbose and out is not None:
            typer.echo(f"[{len(out.outputs[0].token_ids)} tokens, {out.num_cached_tokens} prompt tokens from cache]",
                       err=True)


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
    app.command("chat")(chat)
