"""Resident memory of an engine on the 0.5B shape: after load, and after one 512-token request.

    python benchmarks/load_memory.py                    # 1 GiB KV pool
    python benchmarks/load_memory.py --kv-cache-memory 3GiB

Prints VmHWM (peak RSS), VmRSS, RssAnon and RssFile (pages of mapped files, e.g. the checkpoint)
from /proc/self/status, and the KV pool's size. The target of issue 14 (item 6): peak RSS <=
weights + KV pool + 300 MiB.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def status() -> str:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 2**20
    return "  ".join(f"{k} {v:.2f} GiB" for k, v in fields.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "benchmarks" / ".cache" / "qwen2.5-0.5b"))
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    weights = sum(f.stat().st_size for f in Path(args.model).glob("*.safetensors"))
    llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory, num_threads=args.threads)
    print(f"weights {weights / 2**30:.2f} GiB, KV pool {llm.engine.runner.kv_bytes / 2**30:.2f} GiB")
    print("after load:    ", status())
    llm.generate({"prompt_token_ids": list(range(10, 522))}, SamplingParams(max_tokens=8, temperature=0))
    print("after 512 + 8: ", status())


if __name__ == "__main__":
    main()
