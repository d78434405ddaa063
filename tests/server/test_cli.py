"""`art-server` as a user runs it: a mistake on the command line is one line naming it (no
traceback), `--help` shows every option whole on an 80-column terminal, and a second server on
a data directory another one holds stops at once."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import httpx
import pytest
import torch

from conftest import ROOT, free_port

MISTAKES = {
    "tool_call_parser": (["--tool-call-parser", "bogus"], ["--tool-call-parser bogus", "hermes", "pythonic", "none"]),
    "reasoning_parser": (["--reasoning-parser", "bogus"], ["--reasoning-parser bogus", "qwen3", "deepseek_r1"]),
    "engine": (["--engine", "bogus"], ["--engine bogus", "torch", "vllm"]),
    "dtype": (["--dtype", "fp7"], ["--dtype fp7", "bfloat16"]),
    "device": (["--device", "tpu"], ["--device tpu", "cpu", "cuda"]),
    "model_path": (["--model", "./no-such-model-dir"], ["--model ./no-such-model-dir", "no such file or directory"]),
    "model_gguf_path": (["--model", "/nowhere/model.gguf"], ["--model /nowhere/model.gguf"]),
    "template_kwargs": (["--chat-template-kwargs", "[1]"], ["--chat-template-kwargs", "JSON object"]),
    "port": (["--port", "abc"], ["--port"]),
    "fd_closed": (["--fd", "999"], ["--fd 999: not an open socket"]),
    "fd_a_pipe": (["--fd", "2"], ["--fd 2: not an open socket"]),
    "replicas_vllm": (["--replicas", "2", "--engine", "vllm"], ["--replicas runs torch engines", "--engine vllm"]),
    "stop_token_bad_escape": (["--stop-token", "end\\"], ["--stop-token 'end\\\\'"]),
}


def run_cli(*args: str, columns: int | None = None, pass_fds: tuple[int, ...] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ARTISAN_API_KEY"}
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-m", "server.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, pass_fds=pass_fds)


def assert_one_clear_line(proc: subprocess.CompletedProcess, *words: str) -> None:
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode != 0, out
    assert "Traceback" not in out and len([line for line in out.splitlines() if line.strip()]) <= 3, out
    for w in words:
        assert w in out, out


@pytest.mark.parametrize("name", list(MISTAKES))
def test_a_command_line_mistake_is_one_line(name, tmp_path):
    args, words = MISTAKES[name]
    proc = run_cli("--data-dir", str(tmp_path), "--device", "cpu", *args)
    assert_one_clear_line(proc, *words)


def test_a_stop_token_that_is_not_one_token_stops_the_start_in_one_line(tmp_path):
    """Judged once the tokenizer is loaded (after the model's own loading lines), before anything is served."""
    proc = run_cli("--data-dir", str(tmp_path), "--device", "cpu", "--port", str(free_port()), "--stop-token", "zq xv")
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode != 0 and "Traceback" not in out, out
    assert out.splitlines()[-1].startswith("--stop-token 'zq xv' is 5 tokens of this model's vocabulary"), out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_on_a_machine_without_it_is_one_line(tmp_path):
    proc = run_cli("--device", "cuda", "--data-dir", str(tmp_path), "--port", str(free_port()))
    assert_one_clear_line(proc, "CUDA is not available on this machine; use --device cpu")


def test_an_inherited_socket_open_to_the_world_needs_a_key_as_a_bound_address_does(tmp_path):
    with socket.create_server(("0.0.0.0", 0)) as sock:
        proc = run_cli("--fd", str(sock.fileno()), "--data-dir", str(tmp_path), "--device", "cpu",
                       pass_fds=(sock.fileno(),))
    assert_one_clear_line(proc, "refusing to bind 0.0.0.0 without an API key")


def test_help_shows_every_option_whole_at_80_columns():
    import typer.main

    from server.cli import app

    names = [o for p in typer.main.get_command(app).params for o in p.opts if o.startswith("--")]
    assert "--vllm-gpu-memory-utilization" in names and "--allow-unrendered-tools" in names
    proc = run_cli("--help", columns=80)
    assert proc.returncode == 0, proc.stderr
    for name in names:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", proc.stdout), f"{name} not whole in:\n{proc.stdout}"


def test_a_second_server_on_a_held_data_dir_stops_at_once(fresh_server, tmp_path):
    data_dir = tmp_path / "shared-data"
    first = fresh_server(data_dir=data_dir)
    proc = run_cli("--data-dir", str(data_dir), "--port", str(free_port()), "--device", "cpu")
    assert_one_clear_line(proc, str(data_dir.resolve()), "another art-server holds it")
    assert f"pid {first.proc.pid}" in proc.stderr
    assert httpx.get(first.url + "/health", timeout=30).status_code == 200  # the holder goes on serving
    first.stop()
    again = fresh_server(data_dir=data_dir)  # the lock ends with its holder
    assert httpx.get(again.url + "/health", timeout=30).status_code == 200
