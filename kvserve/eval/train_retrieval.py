"""Train ``kvserve-tiny-retrieval``: a 2-layer Llama + GQA model for the retrieval task.

::

    python -m kvserve.eval.train_retrieval --minutes 14          # resumable: run again to go on
    python -m kvserve.eval.train_retrieval --export-only         # write the shipped folder

Half the training sequences are a haystack with needles followed by several ``? key value``
queries (the loss is on each value only), half are random words repeated (the loss is on the
copy: dense induction, without which the model sits on a "some value of the context" plateau
for thousands of steps); the held-out prompts end after one query's key (the shape the
eval scores). A curriculum grows the haystack from 128 to the held-out length. Everything is
seeded: the data of step ``s`` comes from ``random.Random(seed * 1_000_003 + s)``, the weights
from ``torch.manual_seed(seed)``, so a run resumed from its checkpoint continues exactly.
fp32, on CPU with the default two threads; about 0.4 M parameters.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvserve.eval import retrieval_task as rt

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "assets" / "models" / "kvserve-tiny-retrieval"
HELDOUT = "heldout.jsonl"
HELDOUT_SEED = 15_000


@dataclass(frozen=True)
class TrainConfig:
    """``stages``: ``(haystack length, most steps, batch)`` in order. A stage ends early once the
    accuracy on 64 fresh prompts of its length reaches ``advance_at`` (checked every
    ``eval_every`` steps); the last stage ends there too, or after its steps.
    ``heldout_length`` is the held-out prompts' length (the eval's context)."""

    seed: int = 0
    stages: tuple[tuple[int, int, int], ...] = ((128, 1500, 32), (256, 800, 32), (512, 800, 16),
                                                (1024, 800, 8))
    advance_at: float = 0.95
    eval_every: int = 50
    lr: float = 2e-3
    warmup: int = 50
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    max_needles: int = 16
    queries: int = 8
    repeat_share: float = 0.5
    heldout_length: int = 1024
    heldout_needles: int = 16
    heldout_size: int = 256


def llama_config(cfg: TrainConfig):  # -> transformers.LlamaConfig
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=rt.VOCAB_SIZE, hidden_size=cfg.hidden, intermediate_size=4 * cfg.hidden,
                       num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                       num_key_value_heads=cfg.kv_heads, head_dim=cfg.hidden // cfg.heads,
                       max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                       tie_word_embeddings=True, bos_token_id=None, eos_token_id=[2, 0], pad_token_id=0,
                       dtype="float32")


def retrieval_sequence(rng: random.Random, length: int, cfg: TrainConfig) -> tuple[list[int], list[int]]:
    """A haystack with needles, then ``? key value`` queries; targets are the values."""
    hay = length - 3 * cfg.queries
    needles = rng.randint(min(4, cfg.queries), min(cfg.max_needles, hay // 8))
    queries = min(cfg.queries, needles)
    tokens, placed = rt.haystack(rng, hay, needles)
    asked = rng.sample(range(needles), queries) + [rng.randrange(needles) for _ in range(cfg.queries - queries)]
    where = []
    for i in asked:
        _, key, value = placed[i]
        tokens += [rt.QUERY_ID, key, value]
        where.append(len(tokens) - 2)
    return tokens, where


def repeat_sequence(rng: random.Random, length: int) -> tuple[list[int], list[int]]:
    """Filler with a random segment of words copied later, at a random offset: every position of
    the copy but its first is an induction step (the token after the earlier occurrence of the
    current one), the circuit retrieval needs. The offset varies, so no positional head can
    stand in for matching the content."""
    tokens = [rt.BOS_ID] + [rt.FILLER0 + rng.randrange(rt.FILLERS) for _ in range(length)]
    n = rng.randint(8, max(8, length // 3))
    seg = [rng.randrange(rt.KEY0, rt.FILLER0) for _ in range(n)]  # keys and values: never filler
    first = rng.randint(1, length // 2 - n)
    second = rng.randint(first + n, length - n)
    tokens[first:first + n] = seg
    tokens[second:second + n] = seg
    return tokens, list(range(second, second + n - 1))


def train_batch(rng: random.Random, length: int, batch: int, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[batch, length + 1]`` and labels (the next token where supervised, -100
    elsewhere): a ``repeat_share`` of the rows are :func:`repeat_sequence`, the rest
    :func:`retrieval_sequence`."""
    ids, labels = [], []
    for _ in range(batch):
        tokens, where = (repeat_sequence(rng, length) if rng.random() < cfg.repeat_share
                         else retrieval_sequence(rng, length, cfg))
        tokens = (tokens + [rt.FILLER0] * (length + 1))[:length + 1]
        lab = [-100] * len(tokens)
        for w in where:
            lab[w] = tokens[w + 1]
        ids.append(tokens)
        labels.append(lab)
    return torch.tensor(ids), torch.tensor(labels)


def loss_on(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100)


@torch.no_grad()
def predict(model, examples: list[rt.Example], batch: int = 16) -> list[int]:  # type: ignore[no-untyped-def]
    """Greedy answers of a transformers model to held-out prompts (equal lengths per batch)."""
    out: list[int] = []
    for i in range(0, len(examples), batch):
        ids = torch.tensor([ex.prompt for ex in examples[i:i + batch]])
        hidden = model.model(input_ids=ids).last_hidden_state[:, -1]
        out += model.lm_head(hidden).argmax(-1).tolist()
    return out


def lr_at(step: int, cfg: TrainConfig) -> float:
    return cfg.lr * min(1.0, (step + 1) / cfg.warmup)


def export(model, cfg: TrainConfig, out_dir: Path, metrics: dict[str, object]) -> None:  # type: ignore[no-untyped-def]
    """The shipped folder: weights (fp32), config, tokenizer, held-out set, training record."""
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(eos_token_id=[2, 0], pad_token_id=0, bos_token_id=None)
    model.save_pretrained(out_dir)
    (out_dir / "model.safetensors").chmod(0o644)
    rt.write_tokenizer(out_dir, max_length=2048)
    rt.save_jsonl(heldout(cfg), out_dir / HELDOUT)
    (out_dir / "training.json").write_text(json.dumps({"config": asdict(cfg), **metrics}, indent=1))


def heldout(cfg: TrainConfig) -> list[rt.Example]:
    return rt.make_examples(HELDOUT_SEED + cfg.seed, cfg.heldout_size, cfg.heldout_length, cfg.heldout_needles)


def train(cfg: TrainConfig, work: Path, minutes: float, log=print,  # type: ignore[no-untyped-def]
          max_steps: int | None = None) -> bool:
    """Train from ``work/ckpt.pt`` (if any) for at most ``minutes`` (and ``max_steps`` steps in
    this call); True once the last stage ended."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(llama_config(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.98))
    ckpt = work / "ckpt.pt"
    state: dict[str, object] = {"step": 0, "stage": 0, "stage_step": 0, "history": [], "done": False}
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved.pop("model"))
        opt.load_state_dict(saved.pop("opt"))
        state.update(saved)
        log(f"resumed at step {state['step']} (stage {state['stage']})")
    t0, ran = time.monotonic(), 0

    def save() -> None:
        work.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), **state}, work / "ckpt.tmp")
        (work / "ckpt.tmp").replace(ckpt)

    model.train()
    while not state["done"]:
        if time.monotonic() - t0 > minutes * 60 or (max_steps is not None and ran >= max_steps):
            save()
            log(f"stopped at step {state['step']} (stage {state['stage']}); run again to resume")
            return False
        length, most, batch = cfg.stages[state["stage"]]  # type: ignore[index]
        step = int(state["step"])  # type: ignore[call-overload]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        ids, where = train_batch(random.Random(cfg.seed * 1_000_003 + step), length, batch, cfg)
        loss = loss_on(model, ids, where)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        state["step"], state["stage_step"], ran = step + 1, int(state["stage_step"]) + 1, ran + 1  # type: ignore[call-overload]
        if state["step"] % cfg.eval_every == 0 or state["stage_step"] >= most:
            model.eval()
            probe = rt.make_examples(HELDOUT_SEED + 31 + step, 64, length, min(cfg.heldout_needles, length // 16))
            acc = rt.accuracy(predict(model, probe), probe)
            model.train()
            state["history"].append({"step": step + 1, "length": length,  # type: ignore[attr-defined]
                                     "loss": round(loss.item(), 4), "acc": acc})
            log(f"step {step + 1} len {length} loss {loss.item():.3f} acc@len {acc:.3f} "
                f"{time.monotonic() - t0:.0f}s")
            if acc >= cfg.advance_at or state["stage_step"] >= most:
                last = state["stage"] == len(cfg.stages) - 1
                state["done"] = last
                state["stage"], state["stage_step"] = int(state["stage"]) + (0 if last else 1), 0  # type: ignore[call-overload]
            save()
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("benchmarks/.cache/train-retrieval"),
                   help="checkpoint folder (resumed from when present)")
    p.add_argument("--out", type=Path, default=SHIPPED_DIR, help="the shipped model folder written at the end")
    p.add_argument("--minutes", type=float, default=14.0, help="time budget of this run (then checkpoint)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stages", default=None, help="'LENGTH:STEPS:BATCH,...' (default: the TrainConfig's)")
    p.add_argument("--export-only", action="store_true", help="write --out from the finished checkpoint")
    a = p.parse_args(argv)
    cfg = TrainConfig(seed=a.seed)
    if a.stages:
        cfg = TrainConfig(seed=a.seed, stages=tuple(tuple(int(x) for x in s.split(":")) for s in a.stages.split(",")))  # type: ignore[misc]
    torch.set_num_threads(min(2, torch.get_num_threads()))
    done = True if a.export_only else train(cfg, a.work, a.minutes, log=lambda s: print(s, flush=True))
    if not done:
        return 3
    from transformers import LlamaForCausalLM

    state = torch.load(a.work / "ckpt.pt", weights_only=False)
    model = LlamaForCausalLM(llama_config(cfg))
    model.load_state_dict(state["model"])
    model.eval()
    held = heldout(cfg)
    acc = rt.accuracy(predict(model, held), held)
    print(f"held-out accuracy (transformers, full KV): {acc:.4f} over {len(held)} prompts", flush=True)
    export(model, cfg, a.out, {"steps": state["step"], "heldout_accuracy": acc, "history": state["history"],
                               "threads": torch.get_num_threads()})
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
