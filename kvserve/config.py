"""Frozen configuration records.

Every config is a frozen dataclass validated in ``__post_init__``; a bad value raises
``ValueError`` with a message naming the field and the limit. Values learned at run time (the
number of KV blocks the memory budget buys) never go back into a config: they live in
:class:`kvserve.kv.layout.KVCapacity`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.spec.config import SPECULATIVE_METHODS, SpeculativeConfig  # noqa: F401 (re-exported)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)

_DTYPE_NAMES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


def normalize_dtype(name: str) -> str:
    """Map ``bf16``/``torch.bfloat16``/``bfloat16`` … to one canonical name, or raise."""
    key = name.lower().removeprefix("torch.")
    if key not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; use one of float32, bfloat16, float16")
    return _DTYPE_NAMES[key]


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``kind`` is ``default``, ``linear`` or ``llama3``."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope scaling {self.kind!r}; supported: default, linear, llama3")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read from a Hugging Face ``config.json``.

    Invariant: ``num_attention_heads % num_key_value_heads == 0`` (MHA, GQA and MQA are the
    cases ``==``, ``>`` and ``num_key_value_heads == 1``).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config field {name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0 or null, got {self.sliding_window}")

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Read both config forms: the Hub's (``rope_theta``, ``rope_scaling``, ``torch_dtype``)
        and the one transformers 5 writes (``rope_parameters``, ``dtype``)."""
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot tell which model this is")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
            inter = int(cfg["intermediate_size"])
        except KeyError as exc:
            raise ValueError(f"config.json is missing required field {exc.args[0]!r}") from None
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = cfg.get("head_dim") or hidden // heads
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
        scaling_src = cfg.get("rope_scaling") or rope_params or {}
        rope_scaling = _parse_rope_scaling(scaling_src)
        sliding = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" or arch == "Qwen3ForCausalLM":
            sliding = _qwen_sliding_window(cfg, layers)
        if arch == "LlamaForCausalLM":
            sliding = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=int(sliding) if sliding else None,
            dtype=normalize_dtype(str(dtype)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        """Load ``config.json`` from a checkpoint folder or a direct file path."""
        p = Path(path)
        cfg_file = p / "config.json" if p.is_dir() else p
        if not cfg_file.exists():
            raise FileNotFoundError(f"no config.json at {cfg_file}; pass a Hugging Face checkpoint folder")
        return cls.from_hf_dict(read_json(cfg_file))


def read_json(path: Path) -> Any:
    """Parse a JSON file; malformed JSON is a one-line ValueError naming the file."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


def _qwen_sliding_window(cfg: dict[str, Any], layers: int) -> int | None:
    """Qwen's window applies only with ``use_sliding_window``, and then only to the layers
    ``layer_types`` marks (default: layers ``>= max_window_layers``, as transformers computes).
    kvserve runs one kind of attention on every layer, so a mix is refused."""
    window = cfg.get("sliding_window")
    if not cfg.get("use_sliding_window", False) or not window:
        return None
    first_sliding = int(cfg.get("max_window_layers", 28))
    types = cfg.get("layer_types") or [
        "sliding_attention" if i >= first_sliding else "full_attention" for i in range(layers)
    ]
    if all(t == "full_attention" for t in types):
        return None
    if all(t == "sliding_attention" for t in types):
        return int(window)
    raise ValueError(
        "config mixes sliding-window and full-attention layers (use_sliding_window with "
        f"max_window_layers={first_sliding} of {layers} layers); kvserve needs one kind on every layer"
    )


def _parse_rope_scaling(src: dict[str, Any]) -> RopeScaling:
    kind = src.get("rope_type") or src.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    return RopeScaling(
        kind=kind,
        factor=float(src.get("factor", 1.0)),
        low_freq_factor=float(src.get("low_freq_factor", 1.0)),
        high_freq_factor=float(src.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=src.get("original_max_position_embeddings"),
    )


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20,
          "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_size(value: str | float) -> int:
    """Parse ``"4GiB"``, ``"512MiB"``, ``"2GB"`` or a plain byte count into bytes (> 0)."""
    if isinstance(value, (int, float)):
        n = int(value)
    else:
        m = _SIZE_RE.match(value)
        if not m:
            raise ValueError(f"cannot read memory size {value!r}; write e.g. '4GiB', '512MiB' or a byte count")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if n <= 0:
        raise ValueError(f"memory size must be > 0 bytes, got {value!r}")
    return n


@dataclass(frozen=True)
class CacheConfig:
    """How the KV pool is sized. Exactly one of ``kv_cache_memory`` (bytes) and
    ``kv_cache_fraction`` (of free device memory; of available host memory on CPU) applies;
    ``kv_cache_memory`` wins when both are set."""

    block_size: int = 16
    kv_cache_memory: int | None = None
    kv_cache_fraction: float = 0.3
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    num_blocks_override: int | None = None
    session_idle_timeout_s: float = 600.0
    max_session_tokens: int | None = None
    # or "drop_oldest": drop the oldest turns to fit (recomputed), or "window": keep the first
    # session_sink_tokens and the last tokens in KV (StreamingLLM, no recompute; docs/eviction.md)
    session_overflow: str = "error"
    session_sink_tokens: int = 4  # DEFAULT_SINK_TOKENS
    session_retention_s: float | None = None  # history forgotten after this idle time (None: idle timeout + 30 min)
    max_sessions_per_tenant: int | None = None  # a new session past it forgets the tenant's LRU idle one
    # KV tiers below the pool (kvserve/kv/tiers; docs/tiers.md): each optional and sized
    kv_host_memory: int | None = None   # bytes of host RAM for block objects
    kv_disk_dir: str | None = None      # a directory for block objects and session records
    kv_disk_size: int = 50 * 2**30      # bytes the disk tier may hold
    kv_remote: str | None = None        # redis://HOST:PORT/DB
    kv_tier_write: str = "through"      # or "back": a block is saved when the pool evicts it (docs/tiers.md)
    kv_tier_eviction: str = "lru"       # or "s3fifo" (kvserve/kv/eviction): the host and disk tiers' order
    session_demote_after_s: float = 60.0  # with tiers: an idle session's pool blocks are released (its KV stays below)
    # Lossy KV codecs (kvserve.kv.quant, docs/kv-quant.md): a sequence shorter than
    # kv_quant_min_tokens reads full-precision KV; int4 keys are grouped by kv_quant_group_size
    # tokens (None: min(32, block_size)); int4 keeps a sequence's first kv_quant_sink_tokens exact.
    kv_quant_min_tokens: int = 0
    kv_quant_group_size: int | None = None
    kv_quant_sink_tokens: int = 4  # DEFAULT_SINK_TOKENS
    # Precision per layer (kvserve.kv.calibration, docs/kv-quant.md): with kv_cache_dtype "auto",
    # a budget ("kl=1e-3") or a calibration file makes the engine pick each layer's K and V codec.
    kv_quality_budget: str | None = None
    kv_calibration: str | None = None

    @property
    def calibrated(self) -> bool:
        """True when the engine chooses a per-layer map at start-up (``auto`` + budget or file)."""
        return self.kv_cache_dtype.strip().lower() == "auto" and (
            self.kv_quality_budget is not None or self.kv_calibration is not None)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two > 0, got {self.block_size}")
        if self.kv_quality_budget is not None or self.kv_calibration is not None:
            from kvserve.kv.calibration import parse_quality_budget

            if self.kv_quality_budget is not None:
                parse_quality_budget(self.kv_quality_budget)
            if self.kv_cache_dtype.strip().lower() != "auto":
                raise ValueError(f"kv_quality_budget / kv_calibration choose the codecs per layer, so they need "
                                 f"kv_cache_dtype='auto', got {self.kv_cache_dtype!r}; drop one of them")
        if self.kv_quant_min_tokens < 0:
            raise ValueError(f"kv_quant_min_tokens must be >= 0, got {self.kv_quant_min_tokens}")
        if self.kv_quant_group_size is not None and (
                self.kv_quant_group_size <= 0 or self.block_size % self.kv_quant_group_size):
            raise ValueError(f"kv_quant_group_size must divide block_size ({self.block_size}), "
                             f"got {self.kv_quant_group_size}")
        if self.kv_quant_sink_tokens == DEFAULT_SINK_TOKENS and self.block_size < DEFAULT_SINK_TOKENS:
            # the default (an int4-only setting) follows a block smaller than it; an explicit value is checked
            object.__setattr__(self, "kv_quant_sink_tokens", self.block_size)
        if not 0 <= self.kv_quant_sink_tokens <= self.block_size:
            raise ValueError(f"kv_quant_sink_tokens must be in [0, block_size={self.block_size}], "
                             f"got {self.kv_quant_sink_tokens}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.kv_host_memory is not None and self.kv_host_memory <= 0:
            raise ValueError(f"kv_host_memory must be > 0 bytes, got {self.kv_host_memory}")
        if self.kv_tier_write not in ("through", "back"):
            raise ValueError(f"kv_tier_write must be through or back, got {self.kv_tier_write!r}")
        if self.kv_tier_eviction not in ("lru", "s3fifo"):
            raise ValueError(f"kv_tier_eviction must be lru or s3fifo, got {self.kv_tier_eviction!r}")
        if self.session_demote_after_s <= 0:
            raise ValueError(f"session_demote_after_s must be > 0, got {self.session_demote_after_s}")
        if self.kv_disk_size <= 0:
            raise ValueError(f"kv_disk_size must be > 0 bytes, got {self.kv_disk_size}")
        if self.kv_remote is not None and not self.kv_remote.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"kv_remote must be a redis:// URL, got {self.kv_remote!r}")
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if self.num_blocks_override is not None and self.num_blocks_override <= 0:
            raise ValueError(f"num_blocks must be > 0, got {self.num_blocks_override}")
        if self.session_idle_timeout_s <= 0:
            raise ValueError(f"session_idle_timeout_s must be > 0, got {self.session_idle_timeout_s}")
        if self.max_session_tokens is not None and self.max_session_tokens <= 0:
            raise ValueError(f"max_session_tokens must be > 0, got {self.max_session_tokens}")
        if self.session_retention_s is not None and self.session_retention_s < self.session_idle_timeout_s:
            raise ValueError(f"session_retention_s ({self.session_retention_s}) must be >= "
                             f"session_idle_timeout_s ({self.session_idle_timeout_s})")
        if self.max_sessions_per_tenant is not None and self.max_sessions_per_tenant <= 0:
            raise ValueError(f"max_sessions_per_tenant must be > 0, got {self.max_sessions_per_tenant}")
        if self.session_overflow not in SESSION_OVERFLOW:
            raise ValueError(f"session_overflow must be one of {', '.join(SESSION_OVERFLOW)}, "
                             f"got {self.session_overflow!r}")
        if self.session_sink_tokens < 0:
            raise ValueError(f"session_sink_tokens must be >= 0, got {self.session_sink_tokens}")

    @property
    def tiers(self) -> tuple[str, ...]:
        """The KV tiers configured below the pool, fastest first."""
        return tuple(t for t, on in (("host", self.kv_host_memory is not None), ("disk", self.kv_disk_dir is not None),
                                     ("remote", self.kv_remote is not None)) if on)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits.

    ``max_num_batched_tokens`` is the per-step token budget shared by decodes (one token each)
    and prefill chunks; ``max_model_len`` caps prompt + generated tokens of one request.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {self.max_model_len}")


RUNNER_KINDS = ("inline", "process")
DEFAULT_SINK_TOKENS = 4
SESSION_OVERFLOW = ("error", "drop_oldest", "window")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an :class:`kvserve.engine.engine.LLMEngine` needs to start."""

    model: str
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    num_threads: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: str = "inline"  # "inline": this process; "process": a child process (kvserve.runner.process_runner)
    attention_backend: str = "auto"  # "auto" (measured, cached), "torch_sdpa" or "native" (kvserve.model.attention_choice)
    tensor_parallel_size: int = 1  # > 1: the model split over that many worker processes (kvserve.parallel)

    def __post_init__(self) -> None:
        if self.runner not in RUNNER_KINDS:
            raise ValueError(f"runner must be one of {', '.join(RUNNER_KINDS)}, got {self.runner!r}")
        if self.dtype != "auto":
            normalize_dtype(self.dtype)
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads must be > 0, got {self.num_threads}")
        if self.attention_backend not in ("auto", "torch_sdpa", "native"):
            raise ValueError(f"attention_backend must be auto, torch_sdpa or native, got {self.attention_backend!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
