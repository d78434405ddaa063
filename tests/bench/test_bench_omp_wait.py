"""bench/omp_wait.py, shortened: each wait-policy case in a process of its own, one JSON line with
its times on 1 and 2 threads, and no busy process left behind."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import bench_module

bench = bench_module("omp_wait")


def test_every_case_reports_both_thread_counts_and_stops_its_busy_processes(monkeypatch, capsys):
    started = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(bench.subprocess, "Popen", Recorded)
    monkeypatch.setattr(sys, "argv", ["omp_wait.py", "--layers", "1", "--passes", "2", "--rounds", "1"])
    bench.main()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["products"] == 7
    for case in bench.CASES:
        t = out[case]
        assert t["t1_ms"] > 0 and t["t2_ms"] > 0
        assert t["two_threads_speedup"] == round(t["t1_ms"] / t["t2_ms"], 3)
    busy = [p for p in started if "-c" in p.args]
    assert busy and all(p.poll() is not None for p in busy)


def test_the_spinning_cases_differ_from_art_server_s_only_in_the_spin_count():
    passive = bench.CASES["passive"]
    for case in ("spin", "spin_team_alive", "spin_beside_busy"):
        assert bench.CASES[case] == {**passive, "GOMP_SPINCOUNT": str(bench.SPIN_COUNT)}
