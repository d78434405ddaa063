"""`art-server`: serve a base model and its runs' LoRAs, and train them."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import typer

from server.settings import DEFAULT_CACHE, DEFAULT_MODEL_DIR, REPLICAS_ARE_TORCH, Settings, check_bind

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


@app.command()
def serve(
    model: str = typer.Option(str(DEFAULT_MODEL_DIR), help="A model directory, a Hugging Face hub id, or a .gguf "
                                                           "file (default: the embedded tiny model)."),
    served_model_name: list[str] = typer.Option([], help="Name(s) the base model answers to; the first is the one "
                                                         "it is served as (repeat for more)."),
    chat_template: Path = typer.Option(None, help="A Jinja chat template file, instead of the tokenizer's."),
    chat_template_kwargs: str = typer.Option("{}", help='JSON passed to the template, e.g. \'{"enable_thinking": false}\'.'),
    tool_call_parser: str = typer.Option("auto", help="hermes, llama3_json, mistral, pythonic, openai or none "
                                                      "(auto: from the chat template)."),
    reasoning_parser: str = typer.Option("auto", help="qwen3, deepseek_r1, openai or none (auto: from the template)."),
    allow_unrendered_tools: bool = typer.Option(False, help="Serve requests with tools although the chat template "
                                                            "does not render them (the model never sees them); "
                                                            "without it they get a 400."),
    host: str = typer.Option("127.0.0.1", help="Address to bind. A non-loopback address needs an API key."),
    port: int = typer.Option(8000),
    api_key: str = typer.Option(None, envvar="ARTISAN_API_KEY", help="Key required on every route but /health "
                                "(Bearer or x-api-key); several keys, comma-separated, are separate callers. "
                                "These are admin keys: they see every run."),
    tenant_keys: Path = typer.Option(None, envvar="ARTISAN_TENANT_KEYS", help="A file of tenant keys, one NAME=KEY "
                                     "per line: each tenant sees only the runs it created."),
    max_runs_per_key: int = typer.Option(100, min=1, help="Runs one key may create (a tenant's, or the admin "
                                                          "keys' together); more get a 403."),
    max_connections_per_ip: int = typer.Option(256, min=1, help="Open connections one client address may hold; "
                                                                "more are closed at once."),
    header_timeout: float = typer.Option(10.0, min=0.1, help="Seconds a connection may take to send a request's "
                                                             "headers before it is closed."),
    data_dir: Path = typer.Option(Path("artisan-data"), help="Where runs, checkpoints and logs live."),
    cache_dir: Path = typer.Option(DEFAULT_CACHE, help="Where dequantised GGUF models are kept."),
    engine: str = typer.Option("torch", help="torch (default; CPU or CUDA) or vllm (a vLLM server process beside "
                                             "art-server; see server/engine/vllm.py)."),
    device: str = typer.Option("auto", help="auto, cpu or cuda"),
    dtype: str = typer.Option("auto", help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16"),
    gradient_checkpointing: bool = typer.Option(False, help="Recompute activations in the backward pass: less "
                                                            "memory for long sequences, about a third more time."),
    memory_budget: float = typer.Option(None, min=0.1, help="GB a training step may take art-server to (weights, caches "
                                        "and the step's activations); micro-batches are cut to fit, and a step whose "
                                        "longest sequence cannot is refused (default: its own use plus 90% of what "
                                        "the machine has available when the step starts)."),
    vllm_python: str = typer.Option(None, help="--engine vllm: the Python with vllm installed (default: this one)."),
    vllm_gpu_memory_utilization: float = typer.Option(0.45, min=0.05, max=0.95, help="--engine vllm: its share of "
                                                      "the GPU's memory; the trainer needs the rest."),
    vllm_max_lora_rank: int = typer.Option(64, help="--engine vllm: the largest LoRA rank a run may use."),
    vllm_max_loras: int = typer.Option(8, min=1, help="--engine vllm: adapters decoded in one batch."),
    replicas: int = typer.Option(1, min=1, help="Engine replicas, each a Ray actor with the base model and the runs' "
                                                "adapters, behind this one API (more than 1 needs Ray: the `ray` extra)."),
    train_processes: int = typer.Option(1, min=1, help="Data-parallel training processes (Ray actors; gloo on CPU, "
                                                       "NCCL on GPU): a step's micro-batches are split among them."),
    ray_address: str = typer.Option(None, envvar="RAY_ADDRESS", help="The Ray cluster for --replicas and "
                                                                    "--train-processes (default: a local one)."),
    max_batch: int = typer.Option(64, help="Sequences decoded together."),
    max_waiting: int = typer.Option(512, help="Sequences queued before requests get 503."),
    prefix_cache_mb: int = typer.Option(1024, min=0, help="MiB of recent long prompts' K/V (the torch engine) that "
                                        "a prompt opening the same way reuses instead of prefilling again (0: off)."),
    max_request_bytes: int = typer.Option(64 * 1024 * 1024, help="Larger request bodies get 413."),
    job_time_limit: float = typer.Option(6 * 3600.0, help="Seconds a training job may run before it is stopped."),
    max_job_optimizer_steps: int = typer.Option(1024, min=1, help="Optimizer steps (epochs x minibatches) one training "
                                                "job may take; larger jobs are refused at submission, so that one "
                                                "run's job never holds the others' for long (runs take turns)."),
    adapter_memory_mb: int = typer.Option(None, min=1, help="MiB all runs' adapters, optimizer states and served "
                                          "copies may take together; a run past it is refused (default: what the "
                                          "device has left, less --memory-reserve-mb)."),
    memory_reserve_mb: int = typer.Option(1024, min=0, help="MiB kept free for decoding and training: a new run "
                                          "whose adapter would eat into it is refused."),
    session_ttl: float = typer.Option(3600.0, min=1, help="Seconds a recorded session (and a response kept for "
                                                          "previous_response_id) lives unused."),
    session_max_exchanges: int = typer.Option(1000, min=1, help="Exchanges one recorded session may hold."),
    keep_trajectory_steps: int = typer.Option(None, help="Keep trajectories of only the newest N steps per run "
                                                         "(step metrics are always kept). Default: keep all."),
    export: list[str] = typer.Option([], "--export", envvar="ARTISAN_EXPORT",
                                     help="Send trajectories to langfuse, weave or openpipe (repeat, or comma-separate); "
                                          "each reads its keys from its own environment variables (see exporters/)."),
    export_timeout: float = typer.Option(10.0, help="Seconds an exporter's request may take before it counts as failed."),
    export_queue: int = typer.Option(16, help="Batches (steps) an exporter may have waiting; more are dropped and counted."),
    log_level: str = typer.Option("info", help=", ".join(LOG_LEVELS)),
) -> None:
    template_kwargs = _check_options(chat_template, chat_template_kwargs, tool_call_parser, reasoning_parser, engine,
                                     dtype, log_level)
    if replicas > 1 and engine == "vllm":
        raise SystemExit(REPLICAS_ARE_TORCH)
    from server.model_source import check as check_model

    check_model(model)
    tenants = _tenant_keys(tenant_keys)
    settings = Settings(model=model, served_model_name=served_model_name, chat_template=chat_template,
                        chat_template_kwargs=template_kwargs, tool_call_parser=tool_call_parser,
                        reasoning_parser=reasoning_parser, allow_unrendered_tools=allow_unrendered_tools, host=host,
                        port=port, api_key=api_key or None, tenant_keys=tenants,
                        max_runs_per_key=max_runs_per_key,
                        header_timeout=header_timeout, data_dir=data_dir, cache_dir=cache_dir, engine=engine, device=device, dtype=dtype,
                        gradient_checkpointing=gradient_checkpointing, memory_budget=memory_budget,
                        vllm_python=vllm_python,
                        vllm_gpu_memory_utilization=vllm_gpu_memory_utilization, vllm_max_lora_rank=vllm_max_lora_rank,
                        vllm_max_loras=vllm_max_loras, replicas=replicas, train_processes=train_processes,
                        ray_address=ray_address, max_batch=max_batch, max_waiting=max_waiting,
                        prefix_cache_mb=prefix_cache_mb,
                        max_request_bytes=max_request_bytes, job_time_limit=job_time_limit,
                        max_job_optimizer_steps=max_job_optimizer_steps, adapter_memory_mb=adapter_memory_mb,
                        memory_reserve_mb=memory_reserve_mb, session_ttl=session_ttl, session_max_exchanges=session_max_exchanges,
                        keep_trajectory_steps=keep_trajectory_steps, export=export, export_timeout=export_timeout,
                        export_queue=export_queue)
    check_bind(settings)
    from server.model_host import pick_device  # torch: after the checks that need nothing loaded

    pick_device(device)
    import uvicorn

    from server.app import create_app

    from server.connections import BACKLOG, ConnectionGuard, connection_cap, guarded_protocol, raise_fd_limit
    from server.log_limits import collapse_repeats_on, uvicorn_log_config

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    collapse_repeats_on(logging.getLogger())
    fd_limit = raise_fd_limit()
    guard = ConnectionGuard(max_connections_per_ip, header_timeout, connection_cap(fd_limit))
    logging.getLogger("artisan").info("descriptor limit %d: at most %d connections, %d per address", fd_limit,
                                      guard.max_connections, guard.per_ip)
    uvicorn.run(create_app(settings), host=host, port=port, log_level=log_level, timeout_keep_alive=30,
                http=guarded_protocol(guard), backlog=BACKLOG, log_config=uvicorn_log_config())


def _tenant_keys(path: Path | None) -> dict[str, str]:
    from server.api.auth import read_tenant_keys

    try:
        return read_tenant_keys(path) if path is not None else {}
    except ValueError as e:
        raise SystemExit(str(e))


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
