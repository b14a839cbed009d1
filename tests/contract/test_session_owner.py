"""Session state has one owner (the session table), histories are forgotten after retention, and
a tenant's session cap forgets its own least recently used idle session, never another tenant's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvserve.kv.manager import KVCacheManager
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams

FIELDS = {"token_ids", "turn_starts", "blocks", "num_computed", "busy", "cache_salt", "last_used", "tenant"}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def turn(kv: KVCacheManager, sid: str, tokens: list[int], tenant: str | None = None) -> Request:
    kv.begin_turn(sid, 0, tenant)
    req = Request(f"{sid}-{kv.sessions.get(sid).num_tokens}", tokens, SamplingParams(max_tokens=1), session_id=sid)
    assert kv.allocate_slots(req, len(tokens), kv.get_computed_blocks(req))
    req.num_computed_tokens = len(tokens)
    req.status = RequestStatus.FINISHED_STOPPED
    kv.free(req)
    kv.check()
    return req


def test_idle_sessions_release_kv_then_forget_history_after_retention() -> None:
    clock = Clock()
    kv = KVCacheManager(16, 4, session_idle_timeout_s=10, session_retention_s=100, clock=clock)
    turn(kv, "a", [1, 2, 3, 4, 5])
    clock.t = 5
    turn(kv, "b", [6, 7, 8])
    clock.t = 12  # a idle 12 s > 10: KV released, history kept; b idle 7 s: untouched
    assert kv.expire_sessions() == 1
    kv.check()
    a, b = kv.sessions.get("a"), kv.sessions.get("b")
    assert not a.resident and a.token_ids == [1, 2, 3, 4, 5] and b.resident
    clock.t = 101  # a idle past retention: forgotten; b (96 s) only released
    kv.expire_sessions()
    kv.check()
    assert kv.sessions.get("a") is None and not kv.sessions.get("b").resident and kv.sessions.stats.forgotten == 1
    assert kv.usage().used == 0


def test_a_tenant_cap_forgets_its_own_lru_idle_session() -> None:
    kv = KVCacheManager(32, 4, max_sessions_per_tenant=2, clock=Clock())
    turn(kv, "a1", [1, 2, 3], "A")
    turn(kv, "a2", [4, 5, 6], "A")
    turn(kv, "b1", [7, 8, 9], "B")
    turn(kv, "a3", [1, 1, 1], "A")  # A is at its cap: a1 (its least recently used) is forgotten
    assert [s.session_id for s in kv.sessions.all()] == ["a2", "b1", "a3"]
    assert kv.sessions.count("A") == 2 and kv.sessions.count("B") == 1
    kv.begin_turn("a2", 3, "A")
    kv.begin_turn("a3", 3, "A")
    with pytest.raises(ValueError, match="all serving a turn"):
        kv.begin_turn("a4", 0, "A")  # every A session busy: refused, nothing forgotten
    assert kv.sessions.count("A") == 2
    kv.check()


def test_only_the_session_table_assigns_session_fields() -> None:
    root = Path(__file__).resolve().parents[2] / "kvserve"
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "sessions.py" and path.parent.name == "kv":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if (isinstance(el, ast.Attribute) and el.attr in FIELDS and isinstance(el.value, ast.Name)
                            and "session" in el.value.id.lower()):
                        offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not offenders, offenders


def test_with_tiers_an_idle_session_is_demoted_early_and_keeps_its_history() -> None:
    clock = Clock()
    kv = KVCacheManager(16, 4, session_idle_timeout_s=600, clock=clock, tiers=("host",), session_demote_after_s=5)
    turn(kv, "a", [1, 2, 3, 4, 5])
    clock.t = 4
    assert kv.expire_sessions() == 0 and kv.sessions.get("a").resident
    clock.t = 6  # past demote-after, far from the idle timeout: the pool copy goes, history stays
    assert kv.expire_sessions() == 1
    a = kv.sessions.get("a")
    assert not a.resident and a.token_ids == [1, 2, 3, 4, 5] and kv.usage().used == 0
    kv.check()
    plain = KVCacheManager(16, 4, session_idle_timeout_s=600, clock=clock, session_demote_after_s=5)
    turn(plain, "a", [1, 2, 3, 4, 5])
    clock.t = 20  # no tiers: demotion would lose the KV, so only the idle timeout applies
    assert plain.expire_sessions() == 0 and plain.sessions.get("a").resident
