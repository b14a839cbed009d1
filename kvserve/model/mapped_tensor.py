"""A checkpoint tensor read in place from its safetensors file (memory-mapped, not copied).

For a tied embedding whose logits projection has been packed (:mod:`kvserve.model.cpu_gemm`),
the embedding matrix is only looked up row by row: mapping it from the file means only the pages
of the rows a request touches are resident, instead of a second full copy of a vocab x hidden
matrix (272 MB on the Qwen2.5-0.5B shape). The mapping is private copy-on-write (nothing is ever
written back); the pages are the file's, so the kernel can drop and re-read them under pressure.

Invariant: :func:`map_tensor` returns a tensor equal to ``safe_open(file).get_tensor(name)``, or
``None`` when the tensor is not stored there in ``dtype`` (a cast would need a copy anyway).
The file must not be truncated while the tensor lives (deleting or replacing it is fine).
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def map_tensor(files: list[Path], name: str, dtype: torch.dtype) -> torch.Tensor | None:
    """``name`` from the first of ``files`` that holds it, mapped in place; None if none holds it
    in ``dtype``."""
    for file in files:
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
            info = header.get(name)
            if info is None:
                continue
            if _DTYPES.get(info["dtype"]) != dtype:
                return None
            start, end = info["data_offsets"]
            shape = tuple(info["shape"])
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        count = (end - start) // dtype.itemsize
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=8 + header_len + start).view(shape)
    return None
