"""KV tiers below the pool: host memory, local disk, a Redis server.

A tier holds *block objects* (:mod:`kvserve.kv.tiers.object_format`): one self-contained,
checksummed value per block, keyed by the block's chained hash. Tiers live beside the KV storage
(the runner's side) and are driven only by block operations (``SaveBlock``, ``LoadBlock``); what
each holds is reported back as tier events, so the scheduler's side keeps an index it can look
prefixes up in (:class:`kvserve.kv.tiers.index.TierIndex`) without touching a byte.
"""
