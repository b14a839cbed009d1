"""OpenMP's wait policy: importing kvserve leaves it to the user and libgomp (no PASSIVE forced on
idle cores, where it made decode steps 1.6-1.9x longer), and start-up warns when workers would
spin on a host busier than its CPUs (where PASSIVE is faster)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from kvserve.engine.memory import omp_wait_note


def test_importing_kvserve_sets_no_wait_policy() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = "import os, kvserve, kvserve.engine.llm; print(os.environ.get('OMP_WAIT_POLICY'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"


def test_spinning_workers_on_a_busy_host_get_a_warning_that_says_what_to_set() -> None:
    level, note = omp_wait_note(2, "default", load=3.2, cpus=2)
    assert level == logging.WARNING and "OMP_WAIT_POLICY=PASSIVE" in note and "load average 3.2" in note
    level, note = omp_wait_note(2, "ACTIVE", load=3.2, cpus=2)
    assert level == logging.WARNING and "ACTIVE" in note


def test_no_warning_when_idle_passive_or_single_threaded() -> None:
    assert omp_wait_note(2, "default", load=0.5, cpus=2)[0] == logging.INFO
    assert omp_wait_note(2, "PASSIVE", load=5.0, cpus=2)[0] == logging.INFO
    assert omp_wait_note(1, "default", load=5.0, cpus=2)[0] == logging.INFO  # no workers to spin
    assert "default (spin, then sleep)" in omp_wait_note(2, "default", load=0.0, cpus=2)[1]


def test_the_policy_is_read_as_libgomp_reads_it(monkeypatch) -> None:
    from kvserve.native import wait_policy

    monkeypatch.setenv("OMP_WAIT_POLICY", " passive ")
    assert wait_policy() == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "")
    assert wait_policy() == "default"
