"""Client errors are one line a user can act on, with no traceback (unless --debug or ARTISAN_DEBUG=1),
from the CLI; the library raises typed errors with the same advice."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from client import ConfigError, ServerError, ServerUnreachable, TrainableModel
from client.errors import EXIT_ERROR, EXIT_USAGE
from tests.conftest import ROOT, free_port

KEY = "right-key"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("ARTISAN_API_KEY", "ARTISAN_DEBUG")}
    cmd = [sys.executable, "-m", "client.train", "--no-progress", "--steps", "1", "--eval-tasks", "2", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**clean, "LITELLM_LOCAL_MODEL_COST_MAP": "True", **(env or {})})


def _one_line_error(proc: subprocess.CompletedProcess, *words: str, status: int = EXIT_ERROR) -> str:
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == status, output
    assert "Traceback" not in output
    assert len(output.splitlines()) <= 3, output
    for word in words:
        assert word.lower() in output.lower(), (word, output)
    return output


@pytest.fixture(scope="module")
def keyed_server(fresh_server_module):
    return fresh_server_module(api_key=KEY)


def test_wrong_or_missing_api_key(keyed_server):
    for args, env in ((["--api-key", "wrong"], None), ([], None), ([], {"ARTISAN_API_KEY": "wrong"})):
        proc = _cli("--server", keyed_server.url, *args, env=env)
        _one_line_error(proc, "401", "--api-key", "ARTISAN_API_KEY")


def test_server_not_running_names_the_url_and_art_server():
    url = f"http://127.0.0.1:{free_port()}"
    _one_line_error(_cli("--server", url), url, "art-server", "connection refused")


def test_server_without_scheme():
    port = free_port()
    _one_line_error(_cli("--server", f"127.0.0.1:{port}"), "--server", f"http://127.0.0.1:{port}", status=EXIT_USAGE)


def test_run_name_with_a_space():
    _one_line_error(_cli("--run", "my run"), "--run", "'my run'", "letters, digits", status=EXIT_USAGE)


def test_unknown_example_lists_the_examples():
    _one_line_error(_cli("--example", "retial"), "'retial'", "demo, email, leg_lookup, reasoning_gym, retail", "make_example",
                    status=EXIT_USAGE)


def test_grpo_is_not_a_loss_but_every_loss_is_group_relative():
    out = _one_line_error(_cli("--loss", "grpo"), "ppo, cispo, importance_sampling, awr", status=EXIT_USAGE)
    assert "group-relative advantages are used with every loss" in out


def test_bogus_reward_and_out_of_range_settings():
    _one_line_error(_cli("--reward", "bogus"), "--reward 'bogus'", "env", "ruler", status=EXIT_USAGE)
    _one_line_error(_cli("--reward", "ruler"), "--judge", status=EXIT_USAGE)
    _one_line_error(_cli("--learning-rate", "5"), "--learning-rate", "less than or equal to 1", status=EXIT_USAGE)
    _one_line_error(_cli("--group-size", "0"), "--group-size", status=EXIT_USAGE)


def test_debug_shows_the_traceback():
    for proc in (_cli("--loss", "grpo", "--debug"), _cli("--loss", "grpo", env={"ARTISAN_DEBUG": "1"})):
        assert proc.returncode != 0 and "Traceback" in proc.stderr and "ConfigError" in proc.stderr


async def test_library_raises_typed_errors(keyed_server):
    with pytest.raises(ServerError) as refused:
        await TrainableModel("k").register(keyed_server.url, api_key="wrong")
    assert refused.value.status == 401 and "api_key" in str(refused.value)
    with pytest.raises(ServerUnreachable, match="art-server") as down:
        await TrainableModel("k").register(f"http://127.0.0.1:{free_port()}")
    assert down.value.status is None and isinstance(down.value, ServerError)
    with pytest.raises(ConfigError, match="http://"):
        await TrainableModel("k").register("127.0.0.1:8000")
    model = await TrainableModel("k").register(keyed_server.url, api_key=KEY)
    assert model.step == 0


def test_every_error_is_one_line():
    from client import TooManyExceptions
    from client.errors import one_line

    failed = TooManyExceptions("3 of 4 rollouts failed (limit 2); first error: ConnectError: refused")
    assert one_line(failed) == str(failed)
    bug = one_line(KeyError("multi\nline"))
    assert "\n" not in bug and bug.startswith("KeyError:") and "--debug" in bug
