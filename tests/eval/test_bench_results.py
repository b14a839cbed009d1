"""kvserve.bench.results.write_json: the benchmark scripts' one way to write their JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.bench.results import write_json


def test_the_document_lands_where_asked_its_folder_made_and_the_path_is_said(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "new" / "deeper" / "r.json"
    doc = {"cpu": {"model": "x"}, "ratio": 0.97, "runs": [1.0, 2.5]}
    write_json(out, doc)
    assert json.loads(out.read_text()) == doc
    assert str(out) in capsys.readouterr().err
    write_json(out, {"again": True})  # an existing file is replaced
    assert json.loads(out.read_text()) == {"again": True}
