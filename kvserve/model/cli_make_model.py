"""``kvserve make-model``: registered without importing torch (the CLI starts fast)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvserve.model.presets import PRESETS


def register(app: typer.Typer) -> None:
    """Add ``kvserve make-model`` to the CLI."""

    @app.command("make-model")
    def make_model_cmd(
        preset: Annotated[str, typer.Option(help=f"one of: {', '.join(PRESETS)}")],
        out: Annotated[Path, typer.Option(help="output folder (created)")],
        seed: Annotated[int, typer.Option(help="weights depend only on this seed")] = 0,
        dtype: Annotated[str | None, typer.Option(help="bf16, fp16 or fp32 (default: the preset's)")] = None,
        config_form: Annotated[str, typer.Option(help="config.json form: transformers5 or hub")] = "transformers5",
        force: Annotated[bool, typer.Option(help="overwrite a checkpoint already in --out")] = False,
        tokenizer: Annotated[Path | None, typer.Option(
            help="copy tokenizer.json/tokenizer_config.json from this folder instead of building one")] = None,
    ) -> None:
        """Write a random-weight Hugging Face checkpoint (config, safetensors, tokenizer)."""
        from kvserve.model.make_model import make_model, param_count
        from kvserve.model.presets import get_preset

        root = make_model(preset, out, seed=seed, dtype=dtype, config_form=config_form, force=force,
                          tokenizer_dir=tokenizer)
        typer.echo(f"wrote {get_preset(preset).name} ({param_count(get_preset(preset)):,} parameters) to {root}")
