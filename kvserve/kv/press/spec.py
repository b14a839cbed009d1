"""A request's KV eviction policy, as plain frozen data (it crosses to the runner's attention
settings and into session records).

``sinks``: keep the first ``sink_tokens`` and the last ``window_tokens`` tokens (StreamingLLM),
masked token-exactly; blocks wholly outside both are freed.
``snapkv``: at the end of the prompt, keep the prompt blocks the last ``observe_tokens`` prompt
queries attend to most, removing ``ratio`` of the prompt's blocks.
``h2o``: while decoding, keep ``1 - ratio`` of the blocks by attention accumulated over every
query so far (heavy hitters), evicting one block each time the request outgrows its budget.
The importance policies never drop sink blocks, the last ``recent_tokens`` tokens' blocks, or a
block another holder shares (dropping it would free nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

PRESS_NAMES = ("sinks", "snapkv", "h2o")


@dataclass(frozen=True)
class PressSpec:
    name: str
    ratio: float = 0.0                 # importance policies: fraction of the KV removed (kvpress's count)
    sink_tokens: int = 4
    window_tokens: int | None = None   # sinks: the recent window kept
    observe_tokens: int = 32           # snapkv: the prompt's last queries whose attention scores blocks
    recent_tokens: int = 32            # importance policies: always kept at the end

    def __post_init__(self) -> None:
        if self.name not in PRESS_NAMES:
            raise ValueError(f"unknown KV eviction policy {self.name!r}; choose one of {', '.join(PRESS_NAMES)}")
        if not 0.0 <= self.ratio < 1.0:
            raise ValueError(f"an eviction ratio is the fraction removed, in [0, 1); got {self.ratio}")
        if self.sink_tokens < 0 or self.recent_tokens < 0 or self.observe_tokens <= 0:
            raise ValueError("sink_tokens and recent_tokens must be >= 0 and observe_tokens > 0")
        if self.name == "sinks" and (self.window_tokens is None or self.window_tokens <= 0):
            raise ValueError("the sinks policy needs window_tokens > 0 (the recent tokens it keeps)")

    @property
    def window(self) -> int | None:
        """The token-exact attention window this policy imposes (sinks only)."""
        return self.window_tokens if self.name == "sinks" else None

    @property
    def sinks(self) -> int:
        """Leading tokens every query still attends under the window (sinks only; 0 otherwise)."""
        return self.sink_tokens if self.name == "sinks" else 0


def parse_press(value: str | PressSpec | None) -> PressSpec | None:
    """``"sinks:4,1024"`` / ``"snapkv:0.5"`` / ``"h2o:0.5"`` (or a spec, or None) -> a spec."""
    if value is None or isinstance(value, PressSpec):
        return value
    name, _, args = value.partition(":")
    parts = [p for p in args.split(",") if p]
    try:
        if name == "sinks":
            if len(parts) != 2:
                raise ValueError
            return PressSpec("sinks", sink_tokens=int(parts[0]), window_tokens=int(parts[1]))
        if len(parts) != 1:
            raise ValueError
        return PressSpec(name, ratio=float(parts[0]))
    except ValueError as exc:
        if str(exc).startswith(("unknown", "an eviction", "the sinks", "sink_tokens")):
            raise
        raise ValueError(f"cannot read the KV eviction policy {value!r}: give sinks:S,W, snapkv:RATIO "
                         "or h2o:RATIO") from None
