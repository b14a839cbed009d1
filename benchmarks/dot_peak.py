"""The CPU's bf16 dot-product ceiling, the instruction's own: ``vdpbf16ps`` (AVX512-BF16) on
registers, 16 independent accumulator chains, distinct operands, nothing loaded, one process per
thread at once; beside it torch's bf16 matmul (oneDNN) at n x n x n.

What an attention kernel on this CPU can reach at best: every multiply-accumulate of a prefill
chunk's attention is one lane of such an instruction (32 per instruction), so its time is at least
MACs / this rate. ``benchmarks/paged_kernel.py`` gives the kernel's own rate for a shape.

    python benchmarks/dot_peak.py                 # 2 threads, ~5 s plus the compile
    python benchmarks/dot_peak.py --threads 1

Needs a C compiler and an AVX512-BF16 CPU (else it says so and times only the matmul). Prints a
table and writes JSON (default ``benchmarks/results/dot_peak.json``). Session 18 (Zen 4 EPYC):
3.6 G instructions/s per core, 232 GMAC/s on 2 cores; with one operand reused by every chain the
same loop ran twice as fast, so the operands here are distinct, as in a kernel.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvserve.bench.machine import cpu_info
from kvserve.bench.results import write_json
from kvserve.native import march

SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char** argv) {
  long n = atol(argv[1]);
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  __m512bh x0 = (__m512bh)_mm512_set1_epi32(0x3f803f80), x1 = (__m512bh)_mm512_set1_epi32(0x3f813f80),
           x2 = (__m512bh)_mm512_set1_epi32(0x3f823f80), x3 = (__m512bh)_mm512_set1_epi32(0x3f833f80),
           y0 = (__m512bh)_mm512_set1_epi32(0x30003000), y1 = (__m512bh)_mm512_set1_epi32(0x30013000),
           y2 = (__m512bh)_mm512_set1_epi32(0x30023000), y3 = (__m512bh)_mm512_set1_epi32(0x30033000);
  __m512 b0 = a[0], b1 = a[0], b2 = a[0], b3 = a[0], b4 = a[0], b5 = a[0], b6 = a[0], b7 = a[0],
         b8 = a[0], b9 = a[0], b10 = a[0], b11 = a[0], b12 = a[0], b13 = a[0], b14 = a[0], b15 = a[0];
  double t = now();
  for (long i = 0; i < n; ++i) {
#define D(b, x, y) b = _mm512_dpbf16_ps(b, x, y);
    D(b0, x0, y0) D(b1, x1, y0) D(b2, x2, y0) D(b3, x3, y0) D(b4, x0, y1) D(b5, x1, y1) D(b6, x2, y1) D(b7, x3, y1)
    D(b8, x0, y2) D(b9, x1, y2) D(b10, x2, y2) D(b11, x3, y2) D(b12, x0, y3) D(b13, x1, y3) D(b14, x2, y3) D(b15, x3, y3)
    __asm__ volatile("" : "+v"(x0), "+v"(y0), "+v"(x1), "+v"(y1));
  }
  double dt = now() - t;
  __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(b0, b1), _mm512_add_ps(b2, b3)),
                           _mm512_add_ps(_mm512_add_ps(b4, b5), _mm512_add_ps(b6, b7)));
  s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(b8, b9), _mm512_add_ps(b10, b11)),
                                     _mm512_add_ps(_mm512_add_ps(b12, b13), _mm512_add_ps(b14, b15))));
  printf("%.6f %g\n", n * 16 / dt / 1e9, _mm512_reduce_add_ps(s));
  return 0;
}
"""


def dot_rate(threads: int, iterations: int = 100_000_000) -> float | None:
    """G ``vdpbf16ps`` instructions per second, all ``threads`` processes together; None where the
    build target lacks AVX512-BF16 or there is no compiler."""
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "dot.c", Path(tmp) / "dot"
        src.write_text(SOURCE)
        try:
            subprocess.run(["cc", "-O2", f"-march={march()}", str(src), "-o", str(exe)], check=True,
                           capture_output=True, timeout=120)
        except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            print(f"no vdpbf16ps build here ({type(e).__name__}): the target has no AVX512-BF16 or no compiler",
                  file=sys.stderr)
            return None
        procs = [subprocess.Popen([str(exe), str(iterations)], stdout=subprocess.PIPE, text=True)
                 for _ in range(threads)]
        return sum(float(p.communicate()[0].split()[0]) for p in procs)


def matmul_rate(n: int, repeats: int = 5) -> float:
    """torch's bf16 matmul at n x n x n, GMAC/s."""
    a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
    a @ b
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return n ** 3 * repeats / (time.perf_counter() - t0) / 1e9


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "dot_peak.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: {a.threads}")
    rate = dot_rate(a.threads)
    rows = {"vdpbf16ps_g_per_s": rate, "vdpbf16ps_gmac_per_s": None if rate is None else rate * 32}
    rows.update({f"torch_bf16_matmul_{n}_gmac_per_s": matmul_rate(n) for n in (1024, 2048)})
    for k, v in rows.items():
        print(f"{k:<36} {'n/a' if v is None else f'{v:8.1f}'}")
    write_json(a.json, {"cpu": cpu, "threads": a.threads, "command": " ".join(sys.argv), **rows})


if __name__ == "__main__":
    main()
