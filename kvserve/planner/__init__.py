"""KV capacity planner (``kvserve plan``): bytes per token, the memory ledger, concurrency, speed and
cost bounds, scenario templates and engine config files.

Imports only :mod:`kvserve.config` and :mod:`kvserve.kv.layout` from the rest of kvserve, and uses
the same bytes-per-token and pool-sizing functions as the engine.
"""

from __future__ import annotations
