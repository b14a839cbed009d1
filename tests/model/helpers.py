"""Helpers for the model-runtime tests (fixtures wrapping them live in conftest.py).

* ``build_hf_model(case)``: a random-weight fp32 model made by transformers' own classes (the
  ``hf_checkpoint`` fixture saves each case once per session with ``save_pretrained``). Norm weights and biases are randomised too, so a
  runtime that ignored them would fail parity.
* ``PagedRunner``: the smallest possible engine: a paged KV cache, a block table per sequence (a
  shuffled list of block ids, so paging is really exercised) and a greedy loop that prefills (whole
  or in chunks) then decodes one token per step through :class:`AttentionMetadata`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.config import ModelConfig
from kvserve.model.attention import AttentionMetadata
from kvserve.model.llama import LlamaForCausalLM

_TINY: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
}

# case name -> (transformers config class name, extra config fields)
PARITY_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-mha": ("LlamaConfig", {"num_key_value_heads": 4}),
    "llama-gqa": ("LlamaConfig", {"num_key_value_heads": 2}),
    "llama-mqa-bias": ("LlamaConfig", {"num_key_value_heads": 1, "attention_bias": True}),
    "llama31-rope": ("LlamaConfig", {
        "num_key_value_heads": 2, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "llama-linear-rope": ("LlamaConfig", {
        "num_key_value_heads": 2, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "qwen2-bias-tied": ("Qwen2Config", {"num_key_value_heads": 2, "tie_word_embeddings": True,
                                            "rope_theta": 1000000.0}),
    "qwen3-qknorm": ("Qwen3Config", {"num_key_value_heads": 2, "head_dim": 32}),
    "mistral-window": ("MistralConfig", {"num_key_value_heads": 2, "sliding_window": 16}),
}


def _randomise_extras(model: torch.nn.Module, seed: int) -> None:
    """Norm weights ~ 1 + N(0, 0.2), biases ~ N(0, 0.1): defaults (ones, zeros) would hide bugs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "norm" in name:
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.2)


def build_hf_model(case: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    import transformers

    cls_name, extra = PARITY_CASES[case]
    cfg = getattr(transformers, cls_name)(**{**_TINY, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomise_extras(model, seed)
    return model.eval()


@dataclass
class PagedRunner:
    """Greedy decoding through the paged cache, one or several sequences per step."""

    model: LlamaForCausalLM
    config: ModelConfig
    block_size: int = 4
    num_blocks: int = 96
    seed: int = 0
    backend: Any = None  # an AttentionBackend; None = attention.paged_attention (the torch path)
    kv_caches: list[torch.Tensor] = field(init=False)
    free_blocks: list[int] = field(init=False)

    def __post_init__(self) -> None:
        c = self.config
        dtype = next(self.model.parameters()).dtype
        shape = (2, self.num_blocks, self.block_size, c.num_key_value_heads, c.head_dim)
        # NaN-filled: a read of a slot nobody wrote poisons the output instead of passing silently.
        self.kv_caches = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(c.num_hidden_layers)]
        self.free_blocks = list(range(self.num_blocks))
        random.Random(self.seed).shuffle(self.free_blocks)

    def new_block_table(self, max_tokens: int) -> torch.Tensor:
        n = -(-max_tokens // self.block_size)
        table, self.free_blocks = self.free_blocks[:n], self.free_blocks[n:]
        assert len(table) == n, "test pool too small"
        return torch.tensor(table, dtype=torch.int64)

    def step(self, chunks: list[tuple[list[int], int, torch.Tensor]]) -> torch.Tensor:
        """One forward over ``(new_token_ids, num_computed_before, block_table)`` per sequence.

        Returns logits ``[T, vocab]`` for every new token, packed in order.
        """
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        for new, done, table in chunks:
            for j, tok in enumerate(new):
                p = done + j
                ids.append(tok)
                pos.append(p)
                slots.append(int(table[p // self.block_size]) * self.block_size + p % self.block_size)
            qsl.append(qsl[-1] + len(new))
            seq_lens.append(done + len(new))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc=qsl, seq_lens=seq_lens,
            block_tables=[c[2] for c in chunks], block_size=self.block_size,
        )
        if self.backend is not None:  # as the runner does: the backend plans the step once
            meta.sliding_window = self.config.sliding_window
            meta.backend = self.backend
            meta.plan = self.backend.plan(meta, tuple(self.kv_caches[0].shape), torch.device("cpu"))
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.kv_caches, meta)
            return self.model.compute_logits(hidden)

    def prefill(self, prompt: list[int], table: torch.Tensor, chunk_sizes: list[int] | None = None) -> torch.Tensor:
        """Prefill ``prompt`` (in chunks if given); returns logits for every prompt token ``[P, vocab]``."""
        sizes = chunk_sizes or [len(prompt)]
        assert sum(sizes) == len(prompt)
        out, done = [], 0
        for n in sizes:
            out.append(self.step([(prompt[done:done + n], done, table)]))
            done += n
        return torch.cat(out)

    def greedy(self, prompt: list[int], max_new_tokens: int,
               chunk_sizes: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
        """Greedy tokens after ``prompt`` and the prompt's logits."""
        table = self.new_block_table(len(prompt) + max_new_tokens)
        logits = self.prefill(prompt, table, chunk_sizes)
        tokens = [int(logits[-1].argmax())]
        while len(tokens) < max_new_tokens:
            done = len(prompt) + len(tokens) - 1
            step_logits = self.step([([tokens[-1]], done, table)])
            tokens.append(int(step_logits[-1].argmax()))
        return tokens, logits


def random_prompt(length: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


def check_bf16_against_transformers(model: torch.nn.Module, config: Any, hf: torch.nn.Module) -> list[list[int]]:
    """Prefill 4 random 20-token prompts and assert each's logits are within bf16 rounding of
    transformers in bf16; then a batch of their 4 decodes and the first alone agree to that
    rounding. Returns the prompts."""
    import copy

    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    runner = PagedRunner(model, config)
    prompts = [random_prompt(20, config.vocab_size, seed=s) for s in range(4)]
    tables = [runner.new_block_table(24) for _ in prompts]
    for p, t in zip(prompts, tables):
        ours = runner.prefill(p, t)
        with torch.no_grad():
            ref = hf16(torch.tensor([p])).logits[0].float()
        assert (ours - ref).abs().max().item() <= 0.05 * max(1.0, ref.abs().max().item())
    batch = runner.step([([p[-1]], 20, t) for p, t in zip(prompts, tables)])  # 4 rows
    one = runner.step([([prompts[0][-1]], 20, tables[0])])                    # 1 row
    assert torch.allclose(batch[0], one[0], atol=0.05 * max(1.0, one.abs().max().item()))
    return prompts
