"""Convert a Hugging Face checkpoint to GGUF with llama.cpp's own ``convert_hf_to_gguf.py``.

The converter identifies BPE pre-tokenizers by hashing a test string; our random-weight
checkpoints carry kvserve's own byte-level BPE, which it does not know, so we tell it to treat
the tokenizer as Qwen2's (the same byte-level pre-tokenizer family). The benchmark feeds token
ids, so only the weights matter for speed.

The converter comes from llama-cpp-python's source distribution: run
``benchmarks/setup_llama_cpp.sh`` once (it unpacks it into ``benchmarks/.llama_cpp``), or point
``KVSERVE_LLAMA_CPP_SRC`` at a llama.cpp checkout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(os.environ.get("KVSERVE_LLAMA_CPP_SRC", Path(__file__).resolve().parent / ".llama_cpp"))

_RUNNER = """
import sys
sys.path[:0] = [{src!r}, {gguf!r}]
from conversion import base
_orig = base.TextModel.get_vocab_base_pre
def _pre(self, tokenizer):
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        return "qwen2"
base.TextModel.get_vocab_base_pre = _pre
_orig_sp = base.TextModel._create_vocab_sentencepiece
def _sp(self):
    if not (self.dir_model / "tokenizer.model").is_file():  # no sentencepiece model: skip the import
        raise FileNotFoundError("no tokenizer.model")
    return _orig_sp(self)
base.TextModel._create_vocab_sentencepiece = _sp
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outfile", {out!r}, "--outtype", {outtype!r}]
convert_hf_to_gguf.main()
"""


def to_gguf(model: Path, out: Path, outtype: str = "bf16") -> Path:
    """Write ``out`` (once; reused when it exists) from the checkpoint folder ``model``."""
    if out.exists():
        return out
    script = SRC / "convert_hf_to_gguf.py"
    if not script.exists():
        raise FileNotFoundError(f"{script} not found; run benchmarks/setup_llama_cpp.sh first")
    out.parent.mkdir(parents=True, exist_ok=True)
    code = _RUNNER.format(src=str(SRC), gguf=str(SRC / "gguf-py"), model=str(model), out=str(out), outtype=outtype)
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return out
