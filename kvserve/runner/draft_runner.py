"""The draft model of speculative method ``"draft"``: a small model that proposes tokens in the runner.

The scheduler plans a verify chunk whose last ``model_drafts`` tokens are placeholders
(:data:`kvserve.spec.drafter.DRAFT_PLACEHOLDER`); before the target's forward,
:meth:`DraftRunner.fill` replaces them with the draft model's greedy continuation of the
request's real tokens. The target then verifies them as it verifies n-gram drafts
(``ModelRunner._run``): output is the target's own tokens whatever the draft proposed.

KV rows
-------
The draft model keeps its own KV, in a float pool of ``rows`` fixed rows of ``max_len`` tokens
(``rows * ceil(max_len / block_size)`` blocks, torch.empty: pages are touched only when written).
A row belongs to one request at a time and remembers ``fed``: the tokens whose KV it holds, at
positions ``0 .. len(fed) - 1``. Invariants:

- ``fed`` is exactly what the row's KV was computed from, so a row is valid for a request up to
  the longest common prefix of ``fed`` and the request's real tokens; a fill recomputes from
  there (a rejected draft's KV is rewritten, an accepted one's kept: same token, same position,
  same KV);
- a request's row is dropped when the runner forgets it (finished or preempted), and taken from
  the least recently used request when every row is held (that request recomputes later);
- a fill never writes past ``max_len`` (the draft's ``max_position_embeddings`` or the engine's
  ``max_model_len``, the smaller): drafts there are the last real token repeated (the target
  rejects them; the drafter's policy then pauses the request).

Cost: a fill runs ``k`` draft forwards, all drafted requests batched in each (the first feeds the
tokens the row lacks: the whole context on a request's first draft, in forwards of at most
:data:`CATCH_UP` tokens, one token after a full acceptance, none but the last token otherwise).
A first draft therefore costs the step a draft-model prefill of the request's context.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvserve.config import ModelConfig
from kvserve.contract import ScheduledChunk
from kvserve.kv.codec_names import parse_layer_codecs
from kvserve.kv.layout import int4_group_size
from kvserve.kv.storage import KVStorage
from kvserve.model.attention_backends import AttentionBackend
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import torch_dtype
from kvserve.runner.inputs import build_inputs
from kvserve.runner.state import RequestState
from kvserve.sampling_params import SamplingParams

log = logging.getLogger("kvserve")
_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
CATCH_UP = 1024
"""Most tokens one draft forward feeds a row: a request's first draft catches its row up on the
whole context in slices of this many (the draft's activations stay bounded, as in a chunked prefill)."""


@dataclass(frozen=True)
class DraftSpec:
    """What a runner needs to build its draft model anywhere (plain, picklable)."""

    model: str
    rows: int
    max_len: int


@dataclass
class _Row:
    index: int
    owner: str | None = None
    fed: list[int] = field(default_factory=list)
    used: int = 0


def check_draft_model(target: ModelConfig, target_path: str | Path, draft_path: str | Path) -> ModelConfig:
    """The draft checkpoint's config, after checking it can draft for the target: a Llama-family
    checkpoint whose tokenizer gives every token the target's id. Raises ValueError saying what
    to fix."""
    from kvserve.model.loader import load_model_config, load_tokenizer

    root = Path(draft_path)
    if not (root / "config.json").is_file():
        raise ValueError(f"draft_model {str(draft_path)!r} is not a checkpoint directory (no config.json)")
    draft = load_model_config(root, target.dtype)
    has_tokenizer = any((root / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))
    if has_tokenizer:
        mine, theirs = load_tokenizer(target_path).get_vocab(), load_tokenizer(root).get_vocab()
        differ = [t for t, i in theirs.items() if i < target.vocab_size and mine.get(t) != i]
        if differ:
            raise ValueError(f"draft_model {str(draft_path)!r} has a different tokenizer from the model "
                             f"({len(differ)} tokens differ, e.g. {differ[:3]}); a draft must share the tokenizer")
    else:
        log.warning("draft model %s has no tokenizer files: assuming it shares the model's", root)
    return draft


class DraftRunner:
    """A draft model with its KV rows (module doc). Lives in the runner, beside the target."""

    def __init__(self, model: LlamaForCausalLM, config: ModelConfig, *, rows: int, max_len: int, block_size: int,
                 target_vocab: int, attention: AttentionBackend, device: torch.device) -> None:
        if rows <= 0:
            raise ValueError(f"a draft runner needs rows > 0, got {rows}")
        self.model = model
        self.config = config
        self.max_len = min(max_len, config.max_position_embeddings)
        self.block_size = block_size
        self.vocab = min(target_vocab, config.vocab_size)  # a draft token is always a target token id
        self.attention = attention
        self.device = device
        self.blocks_per_row = math.ceil(self.max_len / block_size)
        dtype = torch_dtype(config.dtype)
        self.storage = KVStorage(
            num_layers=config.num_hidden_layers, num_blocks=rows * self.blocks_per_row, block_size=block_size,
            kv_heads=config.num_key_value_heads, head_dim=config.head_dim, dtype=dtype,
            pool=parse_layer_codecs(config.dtype, config.dtype, config.num_hidden_layers),
            group_size=int4_group_size(block_size), device=device)
        self.rows = [_Row(i) for i in range(rows)]
        self._by_owner: dict[str, _Row] = {}
        self._tick = 0
        self.forwards = 0  # draft forwards run (for tests and benchmarks)

    @property
    def kv_bytes(self) -> int:
        return self.storage.nbytes

    def fill(self, chunks: Sequence[ScheduledChunk], states: dict[str, RequestState]) -> None:
        """Write the draft model's proposals over every chunk's ``model_drafts`` placeholders."""
        jobs = [(c, states[c.request_id]) for c in chunks if c.model_drafts]
        if not jobs:
            return
        self._tick += 1
        self._release(states)
        busy = {c.request_id for c, _ in jobs}
        rows, firsts, wants = [], [], []
        for c, st in jobs:
            last = c.end - c.model_drafts  # tokens[:last] are real; drafts go to last .. c.end - 1
            row = self._row_for(c.request_id, busy)
            real = st.token_ids[:last]
            valid = min(_common_prefix(row.fed, real), last - 1)  # at least the last real token is fed
            del row.fed[valid:]
            rows.append(row)
            firsts.append(real[valid:])
            # positions written: last - 1 + (drafts fed) <= max_len - 1, drafts fed = want - 1
            wants.append(max(0, min(c.model_drafts, self.max_len - last + 1)))
        drafted: list[list[int]] = [[] for _ in jobs]
        behind = [i for i, w in enumerate(wants) if w > 0 and len(firsts[i]) > CATCH_UP]
        while behind:  # a long catch-up in slices: activations stay bounded, as a chunked prefill's
            self._forward([rows[i] for i in behind], [firsts[i][:CATCH_UP] for i in behind], sample=False)
            for i in behind:
                firsts[i] = firsts[i][CATCH_UP:]
            behind = [i for i in behind if len(firsts[i]) > CATCH_UP]
        feeds = firsts
        for step in range(max(wants)):
            live = [i for i, w in enumerate(wants) if w > step]
            tokens = self._forward([rows[i] for i in live], [feeds[i] for i in live])
            for i, t in zip(live, tokens):
                drafted[i].append(t)
            feeds = [[drafted[i][-1]] if drafted[i] else [] for i in range(len(jobs))]
        for (c, st), row, got in zip(jobs, rows, drafted):
            last = c.end - c.model_drafts
            pad = [st.token_ids[last - 1]] * (c.model_drafts - len(got))
            st.token_ids[last:c.end] = got + pad
            row.used = self._tick

    def _forward(self, rows: list[_Row], feeds: list[list[int]], sample: bool = True) -> list[int]:
        """Feed each row its tokens (appended to ``fed``) and return each row's greedy next token
        (nothing when not ``sample``)."""
        chunks, states = [], {}
        for row, feed in zip(rows, feeds):
            start = len(row.fed)
            row.fed.extend(feed)
            rid = row.owner or ""
            table: list[int | None] = list(range(row.index * self.blocks_per_row, (row.index + 1) * self.blocks_per_row))
            chunks.append(ScheduledChunk(rid, start, len(feed), [], table, num_sample=int(sample)))
            states[rid] = RequestState(rid, 0, _GREEDY, 0, None, (), token_ids=row.fed)
        self.storage.begin_step(chunks)
        try:
            layers = self.storage.layers()
            inputs = build_inputs(chunks, states, self.block_size, self.config.sliding_window, self.device,
                                  self.attention, layers[0].shape)
            hidden = self.model(inputs.input_ids, inputs.positions, layers, inputs.meta)
        finally:
            self.storage.end_step()
        self.forwards += 1
        if not sample:
            return []
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return logits[:, :self.vocab].argmax(dim=-1).tolist()

    def _release(self, states: dict[str, RequestState]) -> None:
        """Rows of requests the runner no longer knows (finished, preempted) become free."""
        for owner in [o for o in self._by_owner if o not in states]:
            row = self._by_owner.pop(owner)
            row.owner, row.fed = None, []

    def _row_for(self, request_id: str, busy: set[str]) -> _Row:
        """The request's row; a free one, else the least recently used one not drafting this step."""
        row = self._by_owner.get(request_id)
        if row is not None:
            return row
        free = [r for r in self.rows if r.owner is None]
        if not free:
            free = sorted((r for r in self.rows if r.owner not in busy), key=lambda r: r.used)
            if not free:
                raise RuntimeError(f"more requests drafting than the draft model's {len(self.rows)} rows")
            del self._by_owner[free[0].owner]  # type: ignore[arg-type]
        row = free[0]
        row.owner, row.fed = request_id, []
        self._by_owner[request_id] = row
        return row


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (usually all of ``a``: checked at C speed first)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i
