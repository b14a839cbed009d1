"""Speculative decoding: draft proposers and the scheduler's drafting policy (no torch)."""
