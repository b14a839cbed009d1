"""Forgetting KV on purpose: which of a request's blocks no future query will read.

Plain Python over block indices (no torch). A request's block table may hold *dropped* entries
(``None``): blocks whose reference the request gave back because its attention never reads them
again. Three sources of drops, one rule each:

* the model's own sliding window (Mistral, Qwen2 with ``use_sliding_window``): always on, exact;
* a request's ``sinks`` policy (StreamingLLM: the first S and the last W tokens): opt-in, lossy;
* an importance policy (``snapkv`` at the end of prefill, ``h2o`` while decoding): opt-in, lossy,
  scored by the attention computation itself.

Invariant: a dropped block is never the one a step writes into, and is never read again by the
request that dropped it; other holders of the same block (a shared prefix, a sibling, a session)
keep their reference and their tokens.
"""

from kvserve.kv.press.spec import PRESS_NAMES, PressSpec, parse_press
from kvserve.kv.press.window import droppable, peak_blocks

__all__ = ["PRESS_NAMES", "PressSpec", "droppable", "parse_press", "peak_blocks"]
