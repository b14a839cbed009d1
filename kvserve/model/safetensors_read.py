"""Read a safetensors file tensor by tensor into fresh buffers, without mapping the file.

``safetensors.safe_open`` maps the whole file and hands out views of the mapping: every page read
counts in the process's RSS (as file pages) next to the copies the loader keeps, so a checkpoint
was resident twice at the loading peak. :func:`read_tensors` reads each tensor's bytes with
``readinto`` straight into the tensor that keeps them (the file's pages stay in the page cache,
which is not RSS, and nothing is copied twice). Tensors stored in a dtype this module does not
know are read through ``safe_open`` instead (same values).

Invariant: yields ``(name, tensor)`` equal to ``safe_open(file).get_tensor(name)`` for every tensor
of the file, in file order; each tensor owns its memory (on huge pages where it may: :mod:`kvserve.model.huge_pages`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from kvserve.model import huge_pages

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


def _header(file: Path) -> tuple[int, dict[str, dict[str, object]]]:
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header: dict[str, dict[str, object]] = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def read_tensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``file`` (see the module doc)."""
    base, header = _header(file)
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])  # type: ignore[index]
    if any(str(info["dtype"]) not in DTYPES for _, info in entries):
        from safetensors import safe_open

        with safe_open(str(file), framework="pt", device="cpu") as sf:
            for name, _ in entries:
                yield name, sf.get_tensor(name).clone()
        return
    with open(file, "rb", buffering=0) as f:
        for name, info in entries:
            start, end = info["data_offsets"]  # type: ignore[misc]
            dtype, shape = DTYPES[str(info["dtype"])], tuple(info["shape"])  # type: ignore[arg-type]
            raw = huge_pages.empty((end - start,), torch.uint8)  # weights a decode step streams
            f.seek(base + start)
            view = memoryview(raw.numpy())
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise ValueError(f"{file}: tensor {name} is truncated ({got} of {len(view)} bytes)")
                got += n
            yield name, raw.view(dtype).view(shape)
