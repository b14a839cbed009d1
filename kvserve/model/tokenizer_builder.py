"""A small deterministic byte-level BPE tokenizer for random-weight checkpoints.

Until the shipped model's trained tokenizer is available, ``make-model`` writes this one: a
byte-level BPE (every byte sequence encodes, every token decodes) trained with the ``tokenizers``
library on a fixed text assembled from a few CPython standard-library source files, with ChatML
special tokens and a ChatML chat template. Same Python version + same ``tokenizers`` -> same
``tokenizer.json``.

Special token ids are fixed: ``<|endoftext|>`` = 0, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2.
Ids at or beyond the tokenizer's vocabulary (a model's vocab may be larger) decode to nothing.
Swap this module for the shipped tokenizer by changing :func:`write_tokenizer` only.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2
DEFAULT_VOCAB_SIZE = 1024
# Modules whose source text forms the training corpus (code, comments and English docstrings).
CORPUS_MODULES: tuple[str, ...] = ("textwrap", "string", "heapq", "bisect", "fractions", "shlex", "calendar")

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def corpus_text() -> str:
    """The fixed training text: the sources of :data:`CORPUS_MODULES`, concatenated in order."""
    parts = []
    for name in CORPUS_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise RuntimeError(f"stdlib module {name} not found; cannot build the tokenizer corpus")
        parts.append(Path(spec.origin).read_text(encoding="utf-8"))
    return "\n".join(parts)


def train_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE):  # -> tokenizers.Tokenizer
    """Train the byte-level BPE (``vocab_size`` includes the 256 byte tokens and the specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"tokenizer vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + specials)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines(keepends=True), trainer=trainer)
    return tok


def write_tokenizer(out_dir: str | Path, model_max_length: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> int:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the ChatML template) into
    ``out_dir``; returns the tokenizer's vocabulary size."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab_size)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return int(tok.get_vocab_size())
