"""The KV manager's side of forgetting: block-table entries given back while a request runs.

A mixin of :class:`kvserve.kv.manager.KVCacheManager` (kept apart so each file stays one concept):
it reads and changes only the manager's block tables and the pool's references. No torch.

Invariant: an entry becomes ``None`` exactly when its reference is freed (``dropped_blocks``
counts them), so the manager's ``check()`` (references == held entries) holds after each call.

**Canonical KV.** A block's hash names its tokens, so the prefix cache may only hold KV that any
request with those tokens would compute: KV whose every position attended every earlier key (at
every layer, since later layers' K/V come from earlier layers' attention). Under a lossy policy
that holds only before the policy first hides a key: position ``W + S`` for ``sinks`` (a query
at ``p`` misses keys ``S .. p - W``), the position a request had reached when an importance
policy first dropped a block. Blocks past that boundary are never cached (and a ``sinks``
request takes no prefix hit past it), so no request ever reads another policy's KV as its own.
The model's own window is every request's rule: its KV is canonical throughout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.kv.press import PressSpec, droppable, peak_blocks
from kvserve.kv.press.importance import h2o_drops, snapkv_drops
from kvserve.request import Request

if TYPE_CHECKING:
    from kvserve.kv.block_pool import BlockPool


class Forgetting:
    block_size: int
    sliding_window: int | None
    pool: BlockPool
    dropped_blocks: int
    _tables: dict[str, list[int | None]]
    _lossy_from: dict[str, int]  # request id -> the position its importance policy first dropped at
    _scores: dict[str, list[float]]  # h2o: attention accumulated per logical block

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks of the request's table it still holds (dropped entries excluded)."""
        return sum(1 for b in self._tables.get(request_id, []) if b is not None)

    def window_of(self, req: Request) -> tuple[int | None, int]:
        """The (window, sinks) ``req``'s attention reads: the model's window, narrowed by the
        request's ``sinks`` policy (whose sink tokens then stay readable)."""
        return self.window_for(req.kv_press)

    def window_for(self, press: PressSpec | None) -> tuple[int | None, int]:
        windows = [w for w in (self.sliding_window, press.window if press else None) if w is not None]
        return (min(windows) if windows else None), (press.sinks if press else 0)

    def peak_blocks(self, press: PressSpec | None, num_tokens: int, chunk_tokens: int) -> int:
        """The most blocks a request under ``press`` holds at once on its way to ``num_tokens``
        tokens, computed in steps of at most ``chunk_tokens`` (admission's test;
        :func:`kvserve.kv.press.peak_blocks`)."""
        window, sinks = self.window_for(press)
        return peak_blocks(num_tokens, self.block_size, window, chunk_tokens, sinks)

    def _unread_masked(self, req: Request, blocks: list[int | None], num_computed: int) -> tuple[int | None, ...]:
        """``blocks`` with the entries ``req``'s window no longer reads from ``num_computed`` on
        replaced by None."""
        window, sinks = self.window_of(req)
        gone = droppable(num_computed, self.block_size, window, sinks)
        return tuple(None if i in gone else b for i, b in enumerate(blocks))

    def _holes_allowed(self, req: Request, blocks: list[int | None], num_computed: int) -> bool:
        """Can ``req`` continue from ``blocks``? Only if every dropped entry is one its own window
        would drop, or it runs an importance policy (which accepts what an earlier turn dropped)."""
        if req.kv_press is not None and req.kv_press.name in ("snapkv", "h2o"):
            return True
        window, sinks = self.window_of(req)
        gone = droppable(num_computed, self.block_size, window, sinks)
        return all(i in gone for i, b in enumerate(blocks) if b is None)

    def canonical_tokens(self, req: Request) -> int | None:
        """Positions ``< canonical_tokens`` of ``req`` hold canonical KV (None: all of them)."""
        press = req.kv_press
        static = None if press is None or press.window is None else press.window + press.sinks
        dynamic = self._lossy_from.get(req.request_id)
        bounds = [b for b in (static, dynamic) if b is not None]
        return min(bounds) if bounds else None

    def note_inherited_holes(self, req: Request, blocks: tuple[int | None, ...]) -> None:
        """A turn continuing a session whose earlier turn's policy dropped blocks: its KV is lossy
        from the first dropped block the model's own window would not have dropped (conservative:
        the true boundary is where that turn was when it dropped)."""
        model_gone = droppable(len(blocks) * self.block_size, self.block_size, self.sliding_window)
        first = next((i for i, b in enumerate(blocks) if b is None and i not in model_gone), None)
        if first is not None:
            self._lossy_from.setdefault(req.request_id, first * self.block_size)

    def score_queries(self, req: Request, start: int, num_new: int) -> int:
        """How many of a chunk's last queries score blocks for ``req``'s policy: SnapKV's
        observation window on the chunk that ends the prompt, every query for H2O, else 0."""
        press = req.kv_press
        if press is None:
            return 0
        if press.name == "snapkv":
            return min(press.observe_tokens, num_new) if start + num_new == req.num_prompt_tokens else 0
        return num_new if press.name == "h2o" else 0

    def apply_scores(self, req: Request, scores: list[float] | None) -> int:
        """An importance policy reads this step's block scores and drops what it chooses (never a
        shared block). Returns how many blocks were released."""
        press = req.kv_press
        table = self._tables.get(req.request_id)
        if press is None or scores is None or not table:
            return 0
        held = [b is not None for b in table]
        shared = [b is not None and self.pool.ref_count(b) > 1 for b in table]
        if press.name == "snapkv":
            drops = snapkv_drops(press, scores, held, shared, req.num_prompt_tokens, self.block_size)
        elif press.name == "h2o":
            acc = self._scores.setdefault(req.request_id, [])
            acc.extend([0.0] * (len(scores) - len(acc)))
            for i, x in enumerate(scores):
                acc[i] += x
            drops = h2o_drops(press, acc, held, shared, req.num_computed_tokens, self.block_size)
        else:
            return 0
        return self.drop_blocks(req, drops)

    def forget(self, req: Request) -> int:
        """Give back the blocks of ``req`` no later query reads (outside its window, past its
        sinks). Call after :meth:`cache_blocks`, so a dropped full block stays findable. Returns
        how many were released."""
        table = self._tables.get(req.request_id)
        if not table:
            return 0
        before = self.dropped_blocks
        self._tables[req.request_id] = self._release_unread(req, table, req.num_computed_tokens)
        return self.dropped_blocks - before

    def drop_blocks(self, req: Request, indices: list[int]) -> int:
        """An importance policy's choice: release ``req``'s references on these logical blocks
        (held ones only). Returns how many were released."""
        table = self._tables.get(req.request_id, [])
        released = 0
        if indices:  # KV computed from here on saw less than the whole prefix
            self._lossy_from.setdefault(req.request_id, req.num_computed_tokens)
        for i in indices:
            b = table[i]
            if b is not None:
                self.pool.free([b])
                table[i] = None
                released += 1
        self.dropped_blocks += released
        return released

    def _release_unread(self, req: Request, table: list[int | None], num_computed: int) -> list[int | None]:
        window, sinks = self.window_of(req)
        for i in droppable(num_computed, self.block_size, window, sinks):
            b = table[i] if i < len(table) else None
            if b is not None:
                self.pool.free([b])
                table[i] = None
                self.dropped_blocks += 1
        return table

    def _free_held(self, blocks: list[int | None]) -> None:
        """Drop one reference on each held block, tail first (later blocks are evicted first)."""
        self.pool.free([b for b in reversed(blocks) if b is not None])

