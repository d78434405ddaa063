"""bench/prefix_states.py, shortened: each task after the first resumes from the states kept within
the shared system prompt, and the baseline's from none."""

from __future__ import annotations

import json

from tests.helpers import bench_module

bench = bench_module("prefix_states")


def test_the_bench_resumes_each_task_from_the_states_kept_and_the_baseline_from_none(monkeypatch, capsys):
    monkeypatch.setattr(bench, "SHAPE", {**bench.SHAPE, "hidden_size": 64, "intermediate_size": 128})
    bench.main(tasks=3, system_tokens=1500)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["system_tokens"] > 1024
    assert out["kept_prefix_cache"]["hits"] == 2 and out["kept_prefix_cache"]["tokens_reused"] == 2 * 1024
    assert out["baseline_prefix_cache"]["hits"] == 0
    assert len(out["kept_seconds"]) == len(out["baseline_seconds"]) == 2 and out["speedup"] > 0
