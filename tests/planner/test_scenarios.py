"""Scenario templates: complete, explained, and overridable by options."""

from __future__ import annotations

import pytest

from kvserve.planner.inputs import PlanRequest, resolve_settings
from kvserve.planner.loader import load_model
from kvserve.planner.scenarios import SCENARIOS, find_scenario

REQUIRED = {
    "kv_dtype",
    "block_size",
    "prefix_caching",
    "session_idle_timeout_s",
    "sliding_window",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "reserve",
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_each_scenario_chooses_everything_with_a_reason(name: str) -> None:
    sc = SCENARIOS[name]
    assert REQUIRED <= set(sc.choices)
    for key, choice in sc.choices.items():
        assert choice.reason and "\n" not in choice.reason, key
    r = sc.choices["reserve"].value
    assert isinstance(r, float) and 0.2 <= r <= 0.3


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_settings_resolve(name: str) -> None:
    s = resolve_settings(PlanRequest(model="llama-3.1-8b", scenario=name), load_model("llama-3.1-8b"))
    sc = SCENARIOS[name]
    assert s.scenario == name
    assert s.block_size == sc.choices["block_size"].value
    assert s.max_num_seqs == sc.choices["max_num_seqs"].value
    assert s.prefix_caching is sc.choices["prefix_caching"].value
    assert s.session_idle_timeout_s == sc.choices["session_idle_timeout_s"].value
    assert s.sources["block_size"] == f"scenario {name}"
    assert s.reasons["kv_dtype"] == sc.choices["kv_dtype"].reason


def test_options_override_the_scenario() -> None:
    spec = load_model("llama-3.1-8b")
    s = resolve_settings(
        PlanRequest(
            model="x", scenario="high-concurrency", kv_dtype="fp8", max_num_seqs="8", sliding_window="none"
        ),
        spec,
    )
    assert (s.kv_dtype, s.max_num_seqs, s.sliding_window) == ("fp8", 8, None)
    assert s.sources["kv_dtype"] == "option" and "kv_dtype" not in s.reasons


def test_short_chat_keeps_full_precision_and_long_doc_quantizes() -> None:
    spec = load_model("qwen2.5-7b")
    chat = resolve_settings(PlanRequest(model="x", scenario="short-chat"), spec)
    doc = resolve_settings(PlanRequest(model="x", scenario="long-doc-qa"), spec)
    assert chat.kv_dtype == "bfloat16" and doc.kv_dtype == "int8"
    assert doc.reserve_fraction == 0.3 and chat.reserve_fraction == 0.2


def test_unknown_scenario_suggests() -> None:
    with pytest.raises(ValueError, match="did you mean short-chat"):
        find_scenario("short_chat")
