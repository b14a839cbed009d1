"""The planner's inputs: what the user typed (:class:`PlanRequest`, strings) and what it means
(:class:`Settings`, typed, each value with where it came from).

Every option is read by one parser here, whether it comes from the command line, a scenario or a
``--compare key=a,b,c`` variant, so a bad value gets the same one-line error everywhere.
Precedence: command-line option > scenario template > model (``max_model_len``) > default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace

from kvserve.kv.layout import resolve_kv_dtype
from kvserve.planner import units
from kvserve.planner.model_spec import ModelSpec
from kvserve.planner.params import resolve_weight_dtype
from kvserve.planner.scenarios import DEFAULTS, find_scenario
from kvserve.pricing import Prices


@dataclass(frozen=True)
class PlanRequest:
    """Raw inputs, as typed. ``None`` means "not given"."""

    model: str
    hardware: str | None = None
    memory: str | None = None
    bandwidth: str | None = None
    tflops: str | None = None
    dtype: str | None = None
    kv_dtype: str | None = None
    block_size: str | None = None
    max_model_len: str | None = None
    max_num_seqs: str | None = None
    max_num_batched_tokens: str | None = None
    concurrency: str | None = None
    utilization: str | None = None
    reserve: str | None = None
    tp: str | None = None
    kv_cache_memory: str | None = None
    weights_memory: str | None = None
    sliding_window: str | None = None
    prompt_tokens: str | None = None
    output_tokens: str | None = None
    price_per_hour: str | None = None
    scenario: str | None = None
    # token prices per million (the server's --price-*): a typical request's cost
    price_input: str | None = None
    price_cached_input: str | None = None
    price_output: str | None = None
    cached_fraction: str | None = None
    # precision per layer (kvserve.planner.calibrated): a calibration file, or a budget to calibrate for
    kv_calibration: str | None = None
    kv_quality_budget: str | None = None

    def with_value(self, key: str, value: str) -> PlanRequest:
        """A copy with one input replaced (``--compare``); ``kv-dtype`` and ``kv_dtype`` both work."""
        name = key.strip().replace("-", "_")
        names = [f.name for f in fields(self)]
        if name not in names:
            raise ValueError(f"--compare: unknown input {key!r}; valid: {', '.join(names)}")
        return replace(self, **{name: value})


@dataclass(frozen=True)
class Settings:
    """Typed inputs. ``sources[k]`` is ``option``, ``scenario <name>``, ``model`` or ``default``;
    ``reasons[k]`` is the scenario's one-line reason where a scenario chose ``k``."""

    weight_dtype: str
    kv_dtype: str
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    concurrency: int
    utilization: float
    reserve_fraction: float | None
    reserve_bytes: int | None
    tp: int
    kv_cache_memory: int | None
    weights_memory: int | None
    sliding_window: int | None
    prompt_tokens: int
    output_tokens: int
    price_per_hour: float | None
    prefix_caching: bool
    session_idle_timeout_s: int | None
    scenario: str | None
    sources: dict[str, str] = field(default_factory=dict)
    prices: Prices | None = None  # token prices, as kvserve serve charges them
    cached_fraction: float = 0.0   # share of a typical prompt served from cache
    reasons: dict[str, str] = field(default_factory=dict)


_SIZE_UNIT = re.compile(r"[a-z]", re.IGNORECASE)


def parse_reserve(value: str) -> tuple[float | None, int | None]:
    """``0.2``/``20%`` → a fraction of usable × utilization; ``4GiB`` → a fixed byte count."""
    text = str(value).strip()
    if _SIZE_UNIT.search(text):
        return None, units.parse_memory("--reserve", text)
    return units.parse_fraction("--reserve", text, allow_zero=True), None


def parse_window(value: object) -> int | None:
    if value is None or str(value).strip().lower() in ("none", "off"):
        return None
    return units.parse_tokens("--sliding-window", str(value))


def parse_block_size(value: object) -> int:
    n = units.parse_positive_int("--block-size", str(value))
    if n & (n - 1):
        raise ValueError(f"--block-size must be a power of two (the engine's blocks are), got {n}")
    return n


def resolve_settings(req: PlanRequest, spec: ModelSpec) -> Settings:
    """Parse and validate every input against ``spec``; raises ``ValueError`` with the option's name."""
    scenario = find_scenario(req.scenario) if req.scenario else None
    sources: dict[str, str] = {}
    reasons: dict[str, str] = {}

    def pick(key: str, given: str | None, fallback: object = None) -> object:
        if given is not None:
            sources[key] = "option"
            return given
        if scenario is not None and key in scenario.choices:
            sources[key] = f"scenario {scenario.name}"
            reasons[key] = scenario.choices[key].reason
            return scenario.choices[key].value
        if fallback is not None:
            sources[key] = "model"
            return fallback
        sources[key] = "default"
        return DEFAULTS.get(key)

    weight_dtype = resolve_weight_dtype(req.dtype or "auto", spec.dtype)
    sources["dtype"] = "option" if req.dtype else "model"
    float_dtype = weight_dtype if weight_dtype in ("float32", "bfloat16", "float16") else "bfloat16"
    if req.kv_calibration is not None or req.kv_quality_budget is not None:
        from kvserve.planner.calibrated import planned_map

        kv_dtype, sources["kv_dtype"] = planned_map(
            req.model, spec.num_layers, req.kv_dtype or "auto", calibration=req.kv_calibration,
            budget=req.kv_quality_budget, block_size=parse_block_size(pick("block_size", req.block_size)))
    else:
        kv_dtype = resolve_kv_dtype(str(pick("kv_dtype", req.kv_dtype)), float_dtype)
    max_len_raw = pick("max_model_len", req.max_model_len, spec.max_position_embeddings)
    max_model_len = units.parse_tokens("--max-model-len", str(max_len_raw))
    if sources["max_model_len"].startswith("scenario") and max_model_len > spec.max_position_embeddings:
        max_model_len = spec.max_position_embeddings
        reasons["max_model_len"] += f" (capped at the model's {spec.max_position_embeddings:,} positions)"
    max_num_seqs = units.parse_positive_int("--max-num-seqs", str(pick("max_num_seqs", req.max_num_seqs)))
    concurrency = max_num_seqs
    sources["concurrency"] = "max_num_seqs"
    if req.concurrency is not None:
        concurrency = units.parse_positive_int("--concurrency", req.concurrency)
        sources["concurrency"] = "option"
    reserve_fraction, reserve_bytes = parse_reserve(str(pick("reserve", req.reserve)))
    utilization = units.parse_fraction("--utilization", req.utilization or "0.9")
    sources["utilization"] = "option" if req.utilization else "default"
    sources["scenario"] = "option" if req.scenario else "default"
    sources["price_per_hour"] = "option" if req.price_per_hour else "default"
    tp = units.parse_positive_int("--tp", req.tp or "1")
    sources["tp"] = "option" if req.tp else "default"
    price = units.parse_positive_float("--price-per-hour", req.price_per_hour) if req.price_per_hour else None
    return Settings(
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        block_size=parse_block_size(pick("block_size", req.block_size)),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=units.parse_tokens(
            "--max-num-batched-tokens", str(pick("max_num_batched_tokens", req.max_num_batched_tokens))
        ),
        concurrency=concurrency,
        utilization=utilization,
        reserve_fraction=reserve_fraction,
        reserve_bytes=reserve_bytes,
        tp=tp,
        kv_cache_memory=units.parse_memory("--kv-cache-memory", req.kv_cache_memory)
        if req.kv_cache_memory
        else None,
        weights_memory=units.parse_memory("--weights-memory", req.weights_memory)
        if req.weights_memory
        else None,
        sliding_window=parse_window(pick("sliding_window", req.sliding_window)),
        prompt_tokens=units.parse_tokens("--prompt-tokens", str(pick("prompt_tokens", req.prompt_tokens))),
        output_tokens=units.parse_tokens("--output-tokens", str(pick("output_tokens", req.output_tokens))),
        price_per_hour=price,
        prefix_caching=bool(pick("prefix_caching", None)),
        session_idle_timeout_s=pick("session_idle_timeout_s", None),  # type: ignore[arg-type]
        scenario=scenario.name if scenario else None,
        sources=sources,
        reasons=reasons,
        prices=_prices(req),
        cached_fraction=units.parse_fraction("--cached-fraction", req.cached_fraction or "0", allow_zero=True),
    )


def _prices(req: PlanRequest) -> Prices | None:
    """The token prices given (per million tokens), or None when none is."""
    given = {k: getattr(req, f"price_{k}") for k in ("input", "cached_input", "output")}
    if all(v is None for v in given.values()):
        return None
    return Prices(**{k: _price(f"--price-{k.replace('_', '-')}", v) for k, v in given.items()})


def _price(name: str, value: str | None) -> float:
    try:
        return float(value or 0)
    except ValueError:
        raise ValueError(f"{name} must be a number (per million tokens), got {value!r}") from None
