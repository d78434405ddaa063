"""`art-server`: serve a base model and its runs' LoRAs, and train them."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

import typer

from server.settings import REPLICAS_ARE_TORCH, Settings, check_bind

# torch's OpenMP threads spin while they wait for work; beside another busy process (a client,
# a test, a second server) that spinning starves everyone and decoding slows ~50x on 2 cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Plain click help (not rich's table, which cuts long option names to fit 80 columns), as wide as
# the terminal allows; errors as click's short lines, never a boxed traceback.
app = typer.Typer(add_completion=False, help=__doc__, rich_markup_mode=None, pretty_exceptions_enable=False,
                  context_settings={"max_content_width": 200})
ENGINES = ("torch", "vllm")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def setting(name: str, *param_decls: str, **option: Any) -> Any:
    """The option of Settings' field `name`: its default and help are the field's, so that each
    default is written once, in Settings."""
    field = Settings.model_fields[name]
    return typer.Option(field.get_default(call_default_factory=True), *param_decls, help=field.description, **option)


# The options are Settings' fields by name (settings_of), each with Settings' default, but for two that
# are no setting (--log-level; --fd, whose socket's address stands for --host and --port) and two a
# setting is read from: the template's kwargs as JSON, and the tenants' keys from a file.
@app.command()
def serve(
    ctx: typer.Context,
    model: str = setting("model"),
    served_model_name: list[str] = setting("served_model_name"),
    chat_template: Path = setting("chat_template"),
    chat_template_kwargs: str = typer.Option(json.dumps(Settings.model_fields["chat_template_kwargs"].default),
                                             help=Settings.model_fields["chat_template_kwargs"].description),
    tool_call_parser: str = setting("tool_call_parser"),
    reasoning_parser: str = setting("reasoning_parser"),
    stop_token: list[str] = setting("stop_token"),
    allow_unrendered_tools: bool = setting("allow_unrendered_tools"),
    host: str = setting("host"),
    port: int = setting("port"),
    api_key: str = setting("api_key", envvar="ARTISAN_API_KEY"),
    tenant_keys: Path = typer.Option(None, envvar="ARTISAN_TENANT_KEYS", help="A file of tenant keys, one NAME=KEY "
                                     "per line: each tenant sees only the runs it created."),
    max_runs_per_key: int = setting("max_runs_per_key", min=1),
    header_timeout: float = setting("header_timeout", min=0.1),
    max_requests_per_ip: int = setting("max_requests_per_ip", min=1),
    max_requests: int = setting("max_requests", min=1),
    max_connections_per_ip: int = setting("max_connections_per_ip", min=1),
    data_dir: Path = setting("data_dir"),
    cache_dir: Path = setting("cache_dir"),
    engine: str = setting("engine"),
    device: str = setting("device"),
    dtype: str = setting("dtype"),
    gradient_checkpointing: bool = setting("gradient_checkpointing"),
    share_prefix: bool = setting("share_prefix"),
    decode_copy: bool = setting("decode_copy"),
    memory_budget: float = setting("memory_budget", min=0.1),
    vllm_python: str = setting("vllm_python"),
    vllm_gpu_memory_utilization: float = setting("vllm_gpu_memory_utilization", min=0.05, max=0.95),
    vllm_max_lora_rank: int = setting("vllm_max_lora_rank"),
    vllm_max_loras: int = setting("vllm_max_loras", min=1),
    replicas: int = setting("replicas", min=1),
    train_processes: int = setting("train_processes", min=1),
    ray_address: str = setting("ray_address", envvar="RAY_ADDRESS"),
    max_batch: int = setting("max_batch"),
    max_waiting: int = setting("max_waiting"),
    prefix_cache_mb: int = setting("prefix_cache_mb", min=0),
    prefix_state_every: int = setting("prefix_state_every", min=0),
    kv_cache_mb: int = setting("kv_cache_mb", min=1),
    max_request_bytes: int = setting("max_request_bytes"),
    job_time_limit: float = setting("job_time_limit"),
    max_job_optimizer_steps: int = setting("max_job_optimizer_steps", min=1),
    adapter_memory_mb: int = setting("adapter_memory_mb", min=1),
    memory_reserve_mb: int = setting("memory_reserve_mb", min=0),
    session_ttl: float = setting("session_ttl", min=1),
    session_max_exchanges: int = setting("session_max_exchanges", min=1),
    max_sessions_per_key: int = setting("max_sessions_per_key", min=1),
    session_max_bytes: int = setting("session_max_bytes", min=1),
    keep_trajectory_steps: int = setting("keep_trajectory_steps"),
    export: list[str] = setting("export", "--export", envvar="ARTISAN_EXPORT"),
    export_timeout: float = setting("export_timeout"),
    export_queue: int = setting("export_queue"),
    log_level: str = typer.Option("info", help=", ".join(LOG_LEVELS)),
    fd: int = typer.Option(None, help="Serve on this inherited socket, bound already, instead of binding --host and "
                           "--port: its caller held the port from the moment it chose it (socket activation)."),
) -> None:
    listener = _inherited(fd) if fd is not None else None
    where = dict(zip(("host", "port"), listener.getsockname()[:2])) if listener else {}
    settings = settings_of({**ctx.params, **where})
    check_bind(settings)
    from server.model.host import pick_device  # torch: after the checks that need nothing loaded

    pick_device(device)
    import uvicorn
    from uvicorn.main import STARTUP_FAILURE

    from server.app import create_app

    from server.api.errors import error_body
    from server.connections.limits import BACKLOG, guard_of, guarded_protocol, raise_fd_limit
    from server.log_limits import collapse_repeats_on, uvicorn_log_config

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    collapse_repeats_on(logging.getLogger())
    fd_limit = raise_fd_limit()
    guard = guard_of(settings, fd_limit)
    logging.getLogger("artisan").info("descriptor limit %d: at most %d connections, %d per address; 503 past %d "
                                      "requests in flight, %d per address", fd_limit, guard.max_connections,
                                      guard.per_ip, guard.max_requests, guard.requests_per_ip)
    # uvicorn.run, but for the inherited socket it cannot take (its own --fd makes an AF_UNIX socket of it).
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host=host, port=port, log_level=log_level,
                                           timeout_keep_alive=30, http=guarded_protocol(guard, error_body),
                                           backlog=BACKLOG, log_config=uvicorn_log_config()))
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how it is stopped
        server.run(sockets=[listener] if listener else None)
    if not server.started:
        raise SystemExit(STARTUP_FAILURE)


def _inherited(fd: int) -> socket.socket:
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise SystemExit(f"--fd {fd}: not an open socket ({e.strerror})")
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        raise SystemExit(f"--fd {fd}: not a TCP socket")
    sock.set_inheritable(False)  # the server's own processes (a trainer, a replica) must not hold its port
    return sock


def settings_of(options: dict[str, Any]) -> Settings:
    """The parsed command line as Settings, each option named after a field being that field; the
    mistakes that can be judged before anything loads are refused first, each as one line."""
    template_kwargs = _check_options(options["chat_template"], options["chat_template_kwargs"],
                                     options["tool_call_parser"], options["reasoning_parser"], options["engine"],
                                     options["dtype"], options["log_level"])
    if options["replicas"] > 1 and options["engine"] == "vllm":
        raise SystemExit(REPLICAS_ARE_TORCH)
    from server.model.source import check as check_model

    check_model(options["model"])
    fields = {name: value for name, value in options.items() if name in Settings.model_fields}
    fields.update(chat_template_kwargs=template_kwargs, tenant_keys=_tenant_keys(options["tenant_keys"]),
                  api_key=options["api_key"] or None, stop_token=[_unescaped(t) for t in options["stop_token"]])
    return Settings(**fields)


def _tenant_keys(path: Path | None) -> dict[str, str]:
    from server.api.auth import read_tenant_keys

    try:
        return read_tenant_keys(path) if path is not None else {}
    except ValueError as e:
        raise SystemExit(str(e))


def _unescaped(text: str) -> str:
    """A shell gives `'\\n'` as two characters: read backslash escapes as Python does (other text is kept)."""
    try:
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as e:
        raise SystemExit(f"--stop-token {text!r}: {e.reason}")


def _check_options(chat_template: Path | None, chat_template_kwargs: str, tool_call_parser: str,
                   reasoning_parser: str, engine: str, dtype: str, log_level: str) -> dict:
    """The options that can be judged before anything loads; each mistake is one line."""
    from server.chat.parsers import REASONING_PARSERS, TOOL_PARSERS

    try:
        template_kwargs = json.loads(chat_template_kwargs)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--chat-template-kwargs is not JSON: {e}")
    if not isinstance(template_kwargs, dict):
        raise SystemExit("--chat-template-kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    if chat_template is not None and not chat_template.is_file():
        raise SystemExit(f"--chat-template {chat_template}: no such file")
    for flag, value, valid in (("--tool-call-parser", tool_call_parser, ("auto", *TOOL_PARSERS)),
                               ("--reasoning-parser", reasoning_parser, ("auto", *REASONING_PARSERS)),
                               ("--engine", engine, ENGINES), ("--dtype", dtype, DTYPES),
                               ("--log-level", log_level.lower(), LOG_LEVELS)):
        if value not in valid:
            raise SystemExit(f"{flag} {value}: not one of {', '.join(valid)}")
    return template_kwargs


if __name__ == "__main__":
    app()
