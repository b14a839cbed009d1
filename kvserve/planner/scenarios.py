"""Scenario templates: one set of serving choices per workload, each with its reason.

From the first background article's §8 ("no single set of parameters fits every scenario; keep a
few templates and switch by workload") and its margins (§6.3: keep at least 20% spare, 30% for
long contexts; §7.3: release idle sessions after 5–10 minutes). Any option given on the command
line overrides the template's choice.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass


@dataclass(frozen=True)
class Choice:
    value: object
    reason: str


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    choices: dict[str, Choice]


def _s(name: str, summary: str, **choices: tuple[object, str]) -> Scenario:
    return Scenario(name, summary, {k: Choice(v, r) for k, (v, r) in choices.items()})


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        _s(
            "short-chat",
            "short turns, latency first (article §8.1)",
            kv_dtype=(
                "auto",
                "sequences stay under ~2K tokens: dequantizing would cost more than it saves (§5.1, §6.3)",
            ),
            block_size=(16, "short sequences: small blocks waste at most 15 slots each"),
            prefix_caching=(True, "every request repeats the same system prompt (§5.4)"),
            session_idle_timeout_s=(None, "one-shot requests: blocks are freed when a request finishes"),
            sliding_window=(None, "contexts are short; exact attention costs little"),
            max_model_len=(4096, "turns are mostly under 2K tokens (§8.1); 4K leaves headroom"),
            max_num_seqs=(128, "many small requests; KV is not the constraint at 4K"),
            max_num_batched_tokens=(2048, "small prefill chunks keep decode steps short (latency first)"),
            reserve=(0.2, "at least 20% spare for activations and runtime buffers (§6.3)"),
            prompt_tokens=(512, "typical request: a 512-token prompt"),
            output_tokens=(256, "typical request: a 256-token answer"),
        ),
        _s(
            "long-doc-qa",
            "long inputs, short answers; prefill-bound (article §8.2)",
            kv_dtype=("int8", "long contexts: int8 halves KV with little quality loss (§5.1, §8.2)"),
            block_size=(
                32,
                "long sequences: bigger blocks mean shorter block tables; ≤31 wasted slots is noise",
            ),
            prefix_caching=(True, "questions on the same document share its KV (§8.2)"),
            session_idle_timeout_s=(None, "each question is one request"),
            sliding_window=(None, "answers must see the whole document"),
            max_model_len=(32768, "documents up to ~30K tokens plus the answer"),
            max_num_seqs=(16, "few, large requests; each holds GiBs of KV"),
            max_num_batched_tokens=(8192, "prefill dominates: big chunks use the GPU's FLOPs (§7.2)"),
            reserve=(0.3, "long contexts need 30% spare for activations (§6.3)"),
            prompt_tokens=(16384, "typical request: a 16K-token document"),
            output_tokens=(512, "typical request: a 512-token answer"),
        ),
        _s(
            "multi-turn",
            "conversations that grow turn by turn (article §8.3)",
            kv_dtype=("int8", "sessions accumulate KV; int8 keeps twice as many resident"),
            block_size=(16, "each turn appends a few hundred tokens; small blocks fill quickly"),
            prefix_caching=(True, "each turn re-uses the previous turns' KV and the system prompt (§8.3)"),
            session_idle_timeout_s=(600, "release a session after 10 idle minutes (§7.3: 5–10 min)"),
            sliding_window=(
                8192,
                (
                    "cap a session's KV at its last 8K tokens (§8.3); lossy unless the model was "
                    "trained with a window; --sliding-window none for exact attention"
                ),
            ),
            max_model_len=(32768, "long sessions, with a hard cap on a session's length (§8.3)"),
            max_num_seqs=(64, "tens of open sessions per card"),
            max_num_batched_tokens=(4096, "a new turn's prompt fits in one or two chunks"),
            reserve=(0.25, "between chat (20%) and long context (30%) (§6.3)"),
            prompt_tokens=(4096, "typical turn: 4K tokens of history plus the new message"),
            output_tokens=(256, "typical turn: a 256-token reply"),
        ),
        _s(
            "high-concurrency",
            "memory is the hard limit; many users at once (article §8.4)",
            kv_dtype=("int8", "quantized KV roughly doubles the users that fit (§8.4)"),
            block_size=(16, "paging in small blocks wastes least memory per user (§5.3)"),
            prefix_caching=(True, "shared prompts stored once across users (§5.4, §8.4)"),
            session_idle_timeout_s=(
                300,
                "free idle sessions after 5 minutes: memory is the constraint (§7.3)",
            ),
            sliding_window=(None, "exact attention; concurrency comes from int8 and GQA instead"),
            max_model_len=(8192, "bounded contexts keep per-user KV predictable"),
            max_num_seqs=(256, "the batch is the throughput; KV decides how many really fit"),
            max_num_batched_tokens=(8192, "room for 256 decodes plus prefill chunks in one step"),
            reserve=(0.2, "20% spare for activations and runtime buffers (§6.3)"),
            prompt_tokens=(1024, "typical request: a 1K-token prompt"),
            output_tokens=(256, "typical request: a 256-token answer"),
        ),
    )
}

# What the planner uses when neither an option nor a scenario sets a value.
DEFAULTS: dict[str, object] = {
    "kv_dtype": "auto",
    "block_size": 16,
    "prefix_caching": True,
    "session_idle_timeout_s": 600,
    "sliding_window": None,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 2048,
    "reserve": 0.2,
    "prompt_tokens": 1024,
    "output_tokens": 256,
}


def find_scenario(name: str) -> Scenario:
    key = name.strip().lower()
    if key in SCENARIOS:
        return SCENARIOS[key]
    near = difflib.get_close_matches(key, list(SCENARIOS), n=2, cutoff=0.4)
    hint = f"did you mean {', '.join(near)}? " if near else ""
    raise ValueError(f"unknown scenario {name!r}; {hint}valid: {', '.join(SCENARIOS)}")
