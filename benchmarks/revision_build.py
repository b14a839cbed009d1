"""A native kernel as it was at a git revision, built as a module of its own, so that a benchmark
can run it beside the working tree's build in one process (A/B on a noisy host).

The revision's source (and the local headers it includes) is written under the native build
cache, keyed by its content, and built
with the flags :mod:`kvserve.native` uses; the module name carries the key, so two revisions (or
a revision and the working tree) never share a loaded module.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path
from types import ModuleType

from kvserve.native import cache_dir, march

ROOT = Path(__file__).resolve().parents[1]


def flags() -> list[str]:
    """kvserve.native's flags, for its target (``KVSERVE_NATIVE_MARCH``, default this CPU)."""
    return ["-O3", f"-march={march()}", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]


def build_revision(rev: str, source: str) -> ModuleType:
    """``source`` (a path under the repository, e.g. ``kvserve/native/csrc/tiled_gemm.cpp``) at
    ``rev``, built and loaded."""
    from torch.utils import cpp_extension

    def show(path: str) -> bytes:
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True).stdout

    text = show(source)
    # the revision's own local includes (#include "x.h" beside the source, and theirs in turn:
    # decode_stack.cpp includes paged_attention.cpp, which includes paged_int8.h), written beside it
    headers: dict[str, bytes] = {}
    todo = [text]
    while todo:
        for h in re.findall(rb'#include "([^"]+)"', todo.pop()):
            if h.decode() not in headers:
                headers[h.decode()] = show(str(Path(source).parent / h.decode()))
                todo.append(headers[h.decode()])
    key = hashlib.sha256(text + b"".join(headers[h] for h in sorted(headers)) + " ".join(flags()).encode()).hexdigest()[:12]
    name = f"{Path(source).stem}_at_{key}"
    build = cache_dir() / "native" / name
    build.mkdir(parents=True, exist_ok=True)
    src = build / f"{name}.cpp"
    src.write_bytes(text)
    for h, body in headers.items():
        (build / h).write_bytes(body)
    return cpp_extension.load(name=name, sources=[str(src)], build_directory=str(build), extra_cflags=flags(),
                              extra_ldflags=["-fopenmp"], verbose=False)
