"""Block identity names the model, the codec and the block size, and a request's salt."""

from __future__ import annotations

import json
from pathlib import Path

from kvserve.kv.hashing import hash_full_blocks, model_identity, request_root, root_key


def make_model_dir(path: Path, hidden: int = 64, weight_bytes: int = 10, fill: bytes = b"\0") -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"hidden_size": hidden}))
    (path / "model.safetensors").write_bytes(fill * weight_bytes)
    return path


def test_model_identity_follows_config_and_weight_files(tmp_path: Path) -> None:
    a = model_identity(make_model_dir(tmp_path / "a"))
    assert a == model_identity(make_model_dir(tmp_path / "a-copy"))
    assert a != model_identity(make_model_dir(tmp_path / "b", hidden=128))
    assert a != model_identity(make_model_dir(tmp_path / "c", weight_bytes=11))
    assert a != model_identity(make_model_dir(tmp_path / "d", fill=b"\1"))  # same shapes, other weights


def test_root_key_differs_by_model_codec_and_block_size() -> None:
    base = root_key("m1", "bfloat16", 16)
    assert base == root_key("m1", "bfloat16", 16)
    others = [root_key("m2", "bfloat16", 16), root_key("m1", "int8", 16), root_key("m1", "bfloat16", 32)]
    assert len({base, *others}) == 4
    tokens = list(range(32))
    chains = [hash_full_blocks(tokens, 16, r) for r in (base, *others)]
    assert all(chains[0][i] != c[i] for c in chains[1:] for i in range(2))  # no block hash shared


def test_request_root_salt_and_codec_are_distinct_keys() -> None:
    base = root_key("m", "bfloat16", 16)
    assert request_root(base) == base
    roots = {request_root(base, cache_salt=""), request_root(base, cache_salt="t1"),
             request_root(base, kv_codec="int8"), request_root(base, kv_codec="int8", cache_salt="t1")}
    assert len(roots) == 4 and base not in roots  # an empty salt is a salt, not "no salt"
