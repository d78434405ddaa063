"""bench/gpu.py, the first GPU run's bench, run here as `--device cpu --tiny` so that it cannot rot
before a GPU runs it: every step it takes on CUDA (a random-weight model of a config in
bench/gpu_configs with the embedded tokenizer, static-batch generate, art-server with a LoRA under
1, 8 and 64 concurrent requests, two GRPO steps, the seeded repeat, the new adapter) runs on a tiny
shape, and its JSON line holds every figure the README's "The first GPU run" explains."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from client.local_server import ROOT

DECODE = ("server_c1", "server_c8", "server_c64", "static_c1", "static_c8", "static_c64",
          "server_vs_static_c1", "server_vs_static_c8", "server_vs_static_c64")


@pytest.fixture(scope="module")
def tiny_run() -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--device", "cpu", "--tiny"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]), "\n".join(lines[:-1])


def test_the_json_line_says_what_ran(tiny_run):
    out, _ = tiny_run
    assert (out["bench"], out["device"], out["dtype"], out["tiny"]) == ("gpu", "cpu", "float32", True)
    assert list(out["shapes"]) == ["qwen2-tiny"]


def test_decode_is_measured_through_the_server_and_against_a_static_batch(tiny_run):
    r = tiny_run[0]["shapes"]["qwen2-tiny"]
    for key in DECODE:
        assert r[key] > 0, key
    assert r["server_vs_static_c8"] == pytest.approx(r["server_c8"] / r["static_c8"], rel=0.01)


def test_the_grpo_step_trains_every_sampled_token_on_policy(tiny_run):
    r = tiny_run[0]["shapes"]["qwen2-tiny"]
    groups, size, tokens = r["grpo_batch"]
    assert r["trainable_tokens"] == groups * size * tokens  # ignore_eos: every completion is full length
    assert r["train_tokens_per_s"] > 0 and r["grpo_sample_tokens_per_s"] > 0 and r["step_seconds"] > 0
    assert r["memory_kind"] == "rss" and r["memory_peak_gib"] > 0 and r["memory_loaded_gib"] > 0
    # float32 on one process: the sampler's logprobs are the trainer's, so PPO clips nothing
    assert r["logprob_gap"] is not None and math.isfinite(r["logprob_gap"]) and r["logprob_gap"] < 1e-3
    assert r["clip_fraction"] == 0.0
    assert r["lora_update_norm"] > 0


def test_a_seeded_request_repeats_and_the_new_adapter_is_served(tiny_run):
    r = tiny_run[0]["shapes"]["qwen2-tiny"]
    assert r["seeded_repeat_identical"] is True
    assert r["new_adapter_served"] is True
    assert r["served_step"] == r["trained_step"] == 2


def test_the_table_names_each_shape(tiny_run):
    _, table = tiny_run
    assert "qwen2-tiny" in table and "logprob gap" in table


def test_an_unknown_shape_is_one_line_naming_the_known_ones():
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--device", "cpu", "--shape", "qwen2-70b"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("bench/gpu.py: --shape qwen2-70b: not in bench/gpu_configs "
                                   "(qwen2-0.5b, qwen2-1.5b, qwen2-7b, qwen2-tiny)")
