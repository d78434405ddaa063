"""bench/decode_step.py, shortened: one JSON line with both passes' times for base and LoRA rows, and
the decode pass giving the model's forward's bits on SmolLM2."""

from __future__ import annotations

import json

from tests.helpers import bench_module

bench = bench_module("decode_step")


def test_the_bench_times_both_passes_and_finds_the_same_bits(monkeypatch, capsys):
    monkeypatch.setattr(bench, "STEPS", 2)
    monkeypatch.setattr(bench, "ROUNDS", 1)
    bench.main()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["decode_pass_applies"] and out["same_bits"]
    for key in ("base_r1", "base_r8", "lora_r1", "lora_r8"):
        assert out[f"{key}_forward_ms"] > 0 and out[f"{key}_pass_ms"] > 0
