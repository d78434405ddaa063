"""Each command line's defaults are its config's, written once there: `art-server` with no options
builds exactly `Settings()`, and `python -m client.train` with none exactly `LoopConfig()`, field
by field, through the real parsers. An option given a literal default that differs from its field
(`typer.Option(32)` where Settings says 64) fails here, as the planted ones below show."""

from __future__ import annotations

from typing import Any

import pytest
import typer.main
from pydantic import BaseModel

from client import train as client_train
from client.loop.config import LoopConfig, WarmStart
from client.loop.curriculum import Curriculum
from client.loop.ray_rollouts import RayWorkers
from server import cli as server_cli
from server.settings import Settings

pytestmark = pytest.mark.unit

# The environment variables the two commands read options from: a developer's own must not count.
OPTION_ENV = ("ARTISAN_API_KEY", "ARTISAN_TENANT_KEYS", "RAY_ADDRESS", "ARTISAN_EXPORT", "ARTISAN_RETRY_SECONDS",
              "ARTISAN_DEBUG")
# art-server's options that are no setting, and the two a setting is read from (JSON, a file).
NOT_SETTINGS = {"log_level", "fd"}
READ_INTO_SETTINGS = {"chat_template_kwargs", "tenant_keys"}
# Settings a deployment or a test sets in code, not on the command line.
NOT_OPTIONS = {"max_sessions", "session_max_tokens", "vllm_start_timeout"}


@pytest.fixture(autouse=True)
def no_options_from_the_environment(monkeypatch):
    for name in OPTION_ENV:
        monkeypatch.delenv(name, raising=False)


def command(app: typer.Typer, **planted: Any):
    """The command as its users get it, with a literal default planted on the options named."""
    cmd = typer.main.get_command(app)
    for param in cmd.params:
        if param.name in planted:
            param.default = planted.pop(param.name)
    assert not planted, f"no such options: {planted}"
    return cmd


def parsed(cmd, *argv: str):
    return cmd.make_context(cmd.name or "cli", list(argv))


def differences(got: BaseModel, want: BaseModel) -> dict[str, tuple[Any, Any]]:
    """The fields whose values differ, as (got, want)."""
    a, b = got.model_dump(), want.model_dump()
    return {name: (a[name], b[name]) for name in type(want).model_fields if a[name] != b[name]}


def server_settings(cmd, *argv: str) -> Settings:
    return server_cli.settings_of(parsed(cmd, *argv).params)


def loop_config(cmd, *argv: str) -> LoopConfig:
    ctx = parsed(cmd, *argv)
    cfg = client_train.loop_config(**client_train.config_options(ctx.params, list(ctx.args)))
    # An override of None keeps the example's own setting: the same as no override.
    overrides = {k: v for k, v in cfg.rollout_overrides.items() if v is not None}
    return cfg.model_copy(update={"rollout_overrides": overrides})


def test_art_server_with_no_options_serves_the_default_settings():
    assert differences(server_settings(command(server_cli.app)), Settings()) == {}


def test_every_art_server_option_is_a_setting_with_its_description():
    cmd = command(server_cli.app)
    names = {param.name for param in cmd.params}
    assert names - NOT_SETTINGS <= set(Settings.model_fields), names - NOT_SETTINGS - set(Settings.model_fields)
    assert set(Settings.model_fields) - NOT_OPTIONS <= names, set(Settings.model_fields) - NOT_OPTIONS - names
    for param in cmd.params:
        if param.name in Settings.model_fields and param.name not in READ_INTO_SETTINGS:
            assert param.help == Settings.model_fields[param.name].description, param.name
    assert all(field.description for field in Settings.model_fields.values())


def test_a_literal_art_server_default_that_differs_from_settings_is_caught():
    planted = command(server_cli.app, max_batch=32, session_ttl=60.0)
    assert differences(server_settings(planted), Settings()) == {"max_batch": (32, 64), "session_ttl": (60.0, 3600.0)}


# A command line, and the LoopConfig it means: its parts at their own defaults once switched on.
TRAIN_COMMANDS = {
    "nothing": ([], LoopConfig()),
    "curriculum": (["--curriculum", "0.5"], LoopConfig(curriculum=Curriculum(threshold=0.5))),
    "warm_start": (["--warm-start", "4"], LoopConfig(warm_start=WarmStart(demonstrations=4))),
    "ray": (["--ray-address", "127.0.0.1:6379"], LoopConfig(ray=RayWorkers(address="127.0.0.1:6379"))),
}


@pytest.mark.parametrize("name", list(TRAIN_COMMANDS))
def test_client_train_defaults_are_the_loop_configs(name):
    argv, want = TRAIN_COMMANDS[name]
    assert differences(loop_config(command(client_train.app), *argv), want) == {}


@pytest.mark.parametrize("option, value, name, field", [
    ("steps", 25, "nothing", "steps"),
    ("epochs", 2, "nothing", "train"),
    ("keep_unsolved", True, "nothing", "skip_unsolved"),
    ("curriculum_every", 30, "curriculum", "curriculum"),
    ("warm_start_epochs", 3, "warm_start", "warm_start"),
    ("ray_worker_concurrency", 16, "ray", "ray"),
])
def test_a_literal_client_train_default_that_differs_from_the_loop_configs_is_caught(option, value, name, field):
    argv, want = TRAIN_COMMANDS[name]
    got = differences(loop_config(command(client_train.app, **{option: value}), *argv), want)
    assert list(got) == [field], got
