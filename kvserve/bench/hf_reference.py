"""transformers as the outside reference for the turn experiment.

``hf-recompute`` runs each turn from scratch over the whole history (a fresh cache), as a server
without reuse does; ``hf-reuse`` carries its ``DynamicCache`` across turns and feeds only the new
tokens, as a single-user script with ``past_key_values`` does. Both use the same greedy loop so
TTFT and ms/token are measured the same way as the engine's.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch

from kvserve.bench.turns import TurnRecord, TurnsConfig, _rss, user_turn_tokens


def _load(cfg: TurnsConfig):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvserve.config import normalize_dtype

    dtype = "auto" if cfg.dtype == "auto" else getattr(torch, normalize_dtype(cfg.dtype))
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype).eval()
    tok = AutoTokenizer.from_pretrained(cfg.model, local_files_only=True)
    return model, tok


def _kv_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


@torch.inference_mode()
def run_hf_mode(cfg: TurnsConfig, mode: str, progress: Callable[[int], None] | None = None) -> list[TurnRecord]:
    from transformers import DynamicCache

    model, tok = _load(cfg)
    vocab = min(model.config.vocab_size, len(tok))
    records: list[TurnRecord] = []
    histories: list[list[int]] = [[] for _ in range(cfg.conversations)]
    caches = [DynamicCache(config=model.config) for _ in range(cfg.conversations)]
    for t in range(1, cfg.turns + 1):
        for c in range(cfg.conversations):
            new = user_turn_tokens(cfg, c, t, vocab)
            prompt = histories[c] + new
            if mode == "hf-recompute":
                cache, feed, cached = DynamicCache(config=model.config), prompt, 0
            else:
                cache = caches[c]
                cached = cache.get_seq_length()
                feed = prompt[cached:]
            t0 = time.perf_counter()
            logits = model(torch.tensor([feed]), past_key_values=cache, use_cache=True).logits[0, -1]
            out = [int(logits.argmax())]
            first = time.perf_counter()
            for _ in range(cfg.new_tokens - 1):
                logits = model(torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True).logits[0, -1]
                out.append(int(logits.argmax()))
            end = time.perf_counter()
            histories[c] = prompt + out
            records.append(TurnRecord(
                turn=t, conversation=c, ttft_s=first - t0,
                ms_per_token=(end - first) / max(cfg.new_tokens - 1, 1) * 1e3,
                prompt_tokens=len(prompt), cached_tokens=cached, computed_tokens=len(feed),
                kv_blocks=None, kv_bytes=_kv_bytes(cache), rss_bytes=_rss()))
            if mode == "hf-recompute":
                del cache
        if progress:
            progress(t)
    del model, caches
    gc.collect()
    return records
