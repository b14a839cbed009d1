"""Writing a benchmark's JSON document: the one place benchmarks/ scripts put their results."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def write_json(path: Path, doc: dict) -> None:
    """``doc`` as indented JSON at ``path`` (its folder made), and a line on stderr saying where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}", file=sys.stderr)
