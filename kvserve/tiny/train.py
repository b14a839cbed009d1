"""Train the tiny Llama (GQA) chat model from scratch on the stdlib chat data set.

Deterministic for a given ``TrainConfig`` with ``steps`` set: the data order comes from a seeded
``torch.Generator``, the weights from ``torch.manual_seed`` and the cosine schedule from the step.
With only ``minutes`` set (the machine's CPUs are shared, so the speed of a step is not known up
front) the schedule follows the elapsed share of the budget and training stops when it is spent:
same data order and initial weights, but the number of steps depends on the machine's load.

A checkpoint (bf16 ``model.safetensors`` + configs + the tokenizer) is written every
``checkpoint_minutes`` and at the end, so a usable model exists even if the run is stopped early.
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from kvserve.tiny import data
from kvserve.tiny import tokenizer as tk

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "assets" / "models" / "kvserve-tiny-chat"


@dataclass(frozen=True)
class TrainConfig:
    """Model shape and optimisation settings. ``steps`` or ``minutes`` must be given."""

    num_layers: int = 6
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 2
    intermediate_size: int = 768
    vocab_size: int = tk.DEFAULT_VOCAB_SIZE
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    seq_len: int = 512
    batch_size: int = 4
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    steps: int | None = None
    minutes: float | None = None
    checkpoint_minutes: float = 5.0
    eval_windows: int = 24
    seed: int = 0
    threads: int = 2
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.steps is None and self.minutes is None:
            raise ValueError("give steps or minutes (the schedule needs a length)")
        if self.steps is not None and self.steps <= 0:
            raise ValueError(f"steps must be > 0, got {self.steps}")
        if self.minutes is not None and self.minutes <= 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError(f"seq_len ({self.seq_len}) must be <= max_position_embeddings")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype (of the saved weights) must be bfloat16 or float32, got {self.dtype}")


def llama_config(cfg: TrainConfig):  # -> transformers.LlamaConfig
    """The Hugging Face config of the model ``cfg`` describes (tied embeddings, no BOS)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=[2, 0],
        pad_token_id=0,
        attention_bias=False,
        mlp_bias=False,
    )


def token_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts tokenized and joined, each followed by ``<|endoftext|>`` (id 0); shape [N]."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(0)
    return torch.tensor(ids, dtype=torch.long)


def sample_batch(stream: torch.Tensor, cfg: TrainConfig, gen: torch.Generator) -> torch.Tensor:
    """``batch_size`` random windows of ``seq_len + 1`` tokens; shape [B, T+1]."""
    starts = torch.randint(0, stream.numel() - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
    return torch.stack([stream[s:s + cfg.seq_len + 1] for s in starts.tolist()])


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to ``lr * min_lr_ratio`` at ``total``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def lr_at_fraction(step: int, fraction: float, cfg: TrainConfig) -> float:
    """Time-budget schedule: warmup by step, then cosine over the elapsed share of the budget."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, max(0.0, fraction))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def window_loss(model: torch.nn.Module, windows: torch.Tensor, batch: int = 8) -> float:
    """Mean next-token loss (nats) over fixed windows [W, T+1]."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch]
        logits = model(input_ids=w[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += w[:, 1:].numel()
    model.train()
    return total / count


def save_checkpoint(model: Any, tok: Tokenizer, cfg: TrainConfig, out_dir: Path) -> None:
    """Write the model (in ``cfg.dtype``), tokenizer and generation config as a HF directory."""
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    shipped = copy.deepcopy(model).to(getattr(torch, cfg.dtype))
    shipped.generation_config = GenerationConfig(eos_token_id=[2, 0], pad_token_id=0, bos_token_id=None)
    shipped.save_pretrained(out_dir)
    (out_dir / "model.safetensors").chmod(0o644)  # safetensors writes 0600; installed copies must be readable
    tk.save_tokenizer(tok, out_dir, max_length=cfg.max_position_embeddings)


@dataclass(frozen=True)
class Corpus:
    """Tokenizer plus the tokenized training and held-out streams (each shape [N])."""

    tokenizer: Tokenizer
    train: torch.Tensor
    heldout: torch.Tensor


def prepare_corpus(vocab_size: int = tk.DEFAULT_VOCAB_SIZE) -> Corpus:
    """Build the stdlib chat data set, train the tokenizer on its training part, tokenize both parts."""
    ds = data.build_dataset()
    train_txt = [data.render_chatml(c) for c in ds.train]
    tok = tk.train_tokenizer(train_txt, vocab_size)
    return Corpus(tok, token_stream(tok, train_txt), token_stream(tok, [data.render_chatml(c) for c in ds.heldout]))


def train(cfg: TrainConfig, out_dir: Path = SHIPPED_DIR, log_path: Path | None = None,
          corpus: Corpus | None = None) -> dict[str, object]:
    """Run training and write the checkpoint to ``out_dir``; returns a summary of the run.

    ``corpus`` defaults to :func:`prepare_corpus` (the stdlib); tests pass a small one.
    """
    from transformers import LlamaForCausalLM

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    t0 = time.monotonic()
    corpus = corpus or prepare_corpus(cfg.vocab_size)
    tok, stream, held = corpus.tokenizer, corpus.train, corpus.heldout
    tk.save_tokenizer(tok, out_dir, max_length=cfg.max_position_embeddings)
    gen = torch.Generator().manual_seed(cfg.seed)
    eval_windows = sample_batch(held, TrainConfig(**{**asdict(cfg), "batch_size": cfg.eval_windows}), gen)
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(llama_config(cfg))
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    n_params = sum(p.numel() for p in model.parameters())

    def emit(record: dict[str, object]) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        if log_path:
            with open(log_path, "a", encoding="utf-8") as log:
                log.write(line + "\n")

    emit({"event": "start", "params": n_params, "train_tokens": stream.numel(),
          "heldout_tokens": held.numel(), "prep_s": round(time.monotonic() - t0, 1), "config": asdict(cfg)})
    budget_s = None if cfg.steps is not None else (cfg.minutes or 0.0) * 60
    t_train = time.monotonic()
    last_ckpt = t_train
    step = 0
    loss_val = float("nan")
    while True:
        elapsed = time.monotonic() - t_train
        if (cfg.steps is not None and step >= cfg.steps) or (budget_s is not None and elapsed >= budget_s):
            break
        if cfg.steps is not None:
            lr = lr_at(step, cfg.steps, cfg)
        else:
            assert budget_s is not None
            lr = lr_at_fraction(step, elapsed / budget_s, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = sample_batch(stream, cfg, gen)
        # HF shifts labels inside: the target of position t is input t+1.
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        loss_val = loss.item()
        if step % 10 == 0:
            emit({"event": "step", "step": step, "loss": round(loss_val, 4), "lr": round(lr, 6),
                  "elapsed_s": round(time.monotonic() - t_train, 1), "tokens": step * cfg.batch_size * cfg.seq_len})
        if time.monotonic() - last_ckpt > cfg.checkpoint_minutes * 60:
            emit({"event": "eval", "step": step, "heldout_loss": round(window_loss(model, eval_windows), 4),
                  "elapsed_s": round(time.monotonic() - t_train, 1)})
            save_checkpoint(model, tok, cfg, out_dir)
            last_ckpt = time.monotonic()
    held_loss = window_loss(model, eval_windows)
    save_checkpoint(model, tok, cfg, out_dir)
    summary = {"event": "done", "steps": step, "train_s": round(time.monotonic() - t_train, 1),
               "final_train_loss": round(loss_val, 4), "heldout_loss": round(held_loss, 4),
               "heldout_ppl_windows": round(math.exp(held_loss), 3)}
    emit(summary)
    return summary
