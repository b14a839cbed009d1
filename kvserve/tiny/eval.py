"""Held-out perplexity, greedy samples and the loss-curve plot for the tiny model.

Perplexity here is computed with ``transformers`` on the shipped checkpoint (the kvserve engine
has its own ``eval``). Each held-out conversation is scored on its own, cut into non-overlapping
windows of at most ``window`` tokens; the first token of each window has no context and is not
scored. ``ppl = exp(total NLL / scored tokens)``.

    .venv/bin/python -m kvserve.tiny.eval                 # full held-out set + samples
    .venv/bin/python -m kvserve.tiny.eval --plot /tmp/train_tiny.log docs/img/tiny_loss.png
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.tiny import data

SAMPLE_PROMPTS: tuple[str, ...] = (
    "Write the function `def is_palindrome(s)` for `strutil`:\n\nReturn True if s reads the same backwards.",
    "Write the class `class Stack` for `collections`:\n\nA last-in, first-out stack backed by a list.",
    "Write the function `def read_lines(path)` for `fileutil`:\n\nReturn the lines of the file at path.",
    "Explain the Python topic `assert`.",
)


@dataclass(frozen=True)
class Perplexity:
    """Token-weighted held-out result. ``ppl == exp(nll)``."""

    nll: float
    tokens: int
    texts: int

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)


def load(model_dir: Path, dtype: torch.dtype = torch.float32):  # -> (model, tokenizer)
    """The checkpoint and tokenizer, from local files only."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = LlamaForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=dtype)
    model.eval()
    return model, tok


def heldout_subset(max_texts: int | None = None, max_chars: int | None = None) -> list[str]:
    """A fixed, evenly spaced subset of the held-out texts (all of them by default)."""
    texts = data.heldout_texts()
    if max_texts is not None and max_texts < len(texts):
        step = len(texts) / max_texts
        texts = [texts[int(i * step)] for i in range(max_texts)]
    if max_chars is not None:
        texts = [t[:max_chars] for t in texts]
    return texts


@torch.no_grad()
def perplexity(model: torch.nn.Module, tok, texts: list[str], window: int = 512) -> Perplexity:
    """Held-out perplexity of ``texts`` (each scored separately) under ``model``."""
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    total, count = 0.0, 0
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start:start + window]])
            if chunk.shape[1] < 2:
                continue
            logits = model(input_ids=chunk).logits.float()  # [1, T, V]
            nll = torch.nn.functional.cross_entropy(logits[0, :-1], chunk[0, 1:], reduction="sum")
            total += nll.item()
            count += chunk.shape[1] - 1
    if count == 0:
        raise ValueError("no tokens to score")
    return Perplexity(total / count, count, len(texts))


@torch.no_grad()
def greedy_reply(model: Any, tok, user: str, max_new_tokens: int = 96) -> str:
    """The model's greedy answer to one user turn, through the chat template."""
    prompt = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                     tokenize=False)
    x = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    out = model.generate(x, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[2, 0], pad_token_id=0)
    return tok.decode(out[0, x.shape[1]:], skip_special_tokens=True)


def plot_loss(log_path: Path, png_path: Path) -> None:
    """Draw train loss (per logged step) and held-out window loss from a training JSON-lines log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses, e_steps, e_losses = [], [], [], []
    for line in log_path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "step":
            steps.append(rec["step"])
            losses.append(rec["loss"])
        elif rec.get("event") == "eval":
            e_steps.append(rec["step"])
            e_losses.append(rec["heldout_loss"])
        elif rec.get("event") == "done":
            e_steps.append(rec["steps"])
            e_losses.append(rec["heldout_loss"])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, label="train loss (one batch)", lw=1)
    ax.plot(e_steps, e_losses, "o-", label="held-out loss (fixed windows)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("kvserve-tiny-chat training")
    ax.grid(alpha=0.3)
    ax.legend()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    from kvserve.assets import default_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--max-texts", type=int, default=None)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--plot", nargs=2, type=Path, metavar=("LOG", "PNG"), default=None)
    p.add_argument("--no-samples", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(2)
    if a.plot:
        plot_loss(*a.plot)
        print(f"wrote {a.plot[1]}")
        return
    model, tok = load(a.model or default_model_path())
    result = perplexity(model, tok, heldout_subset(a.max_texts), a.window)
    print(json.dumps({"heldout_texts": result.texts, "tokens": result.tokens,
                      "nll": round(result.nll, 4), "ppl": round(result.ppl, 3)}))
    if not a.no_samples:
        for prompt in SAMPLE_PROMPTS:
            print(f"--- user: {prompt}\n--- assistant:\n{greedy_reply(model, tok, prompt)}\n")


if __name__ == "__main__":
    main()
