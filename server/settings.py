"""Server settings and the bind check: importable without torch, so the CLI refuses a bad
configuration at once."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

DEFAULT_MODEL_DIR = Path(__file__).parent / "embedded" / "model"
REPLICAS_ARE_TORCH = "--replicas runs torch engines on Ray; with --engine vllm, leave --replicas at 1"
DEFAULT_CACHE = Path(os.environ.get("ARTISAN_CACHE", Path.home() / ".cache" / "artisan"))


class Settings(BaseModel):
    """What art-server serves and how; each field's default and description are also its
    command-line option's (server/cli.py), so a default is written here alone."""

    # server/model/source.py reads it.
    model: str = Field(default=str(DEFAULT_MODEL_DIR), description="A model directory, a Hugging Face hub id, or a "
                       ".gguf file (default: the embedded tiny model).")
    served_model_name: list[str] = Field(default=[], description="Name(s) the base model answers to; the first is the "
                                         "one it is served as (repeat for more).")
    chat_template: Path | None = Field(default=None, description="A Jinja chat template file, instead of the "
                                       "tokenizer's.")
    chat_template_kwargs: dict[str, Any] = Field(default={}, description='JSON passed to the template, e.g. '
                                                 '\'{"enable_thinking": false}\'.')
    tool_call_parser: str = Field(default="auto", description="hermes, llama3_json, mistral, pythonic, openai or none "
                                  "(auto: from the chat template).")
    reasoning_parser: str = Field(default="auto", description="qwen3, deepseek_r1, openai or none (auto: from the "
                                  "template).")
    stop_token: list[str] = Field(default=[], description="A token's text that ends every generation, besides the "
                                  "model's EOS and its template's end of turn (repeat for more): a base model served "
                                  "with a plain-text template ends its turn at a newline, --stop-token '\\n' "
                                  "(backslash escapes are read).")
    allow_unrendered_tools: bool = Field(default=False, description="Serve requests with tools although the chat "
                                         "template does not render them (the model never sees them); without it "
                                         "they get a 400.")
    host: str = Field(default="127.0.0.1", description="Address to bind. A non-loopback address needs an API key.")
    port: int = Field(default=8000, description="Port to listen on.")
    api_key: str | None = Field(default=None, description="Key required on every route but /health (Bearer or "
                                "x-api-key); several keys, comma-separated, are separate callers. These are admin "
                                "keys: they see every run.")
    # From --tenant-keys FILE (server/api/auth.py reads it).
    tenant_keys: dict[str, str] = Field(default={}, description="Tenant keys, name -> key: each tenant sees only the "
                                        "runs it created.")
    max_runs_per_key: int = Field(default=100, description="Runs one key may create (a tenant's, or the admin keys' "
                                  "together); more get a 403.")
    # server/connections/limits.py enforces these: soft caps on requests in flight (past them a 503 with
    # Retry-After), a hard cap on connections well above them (past it a closed connection).
    header_timeout: float = Field(default=10.0, description="Seconds a connection may take to send a request's "
                                  "headers before it is closed.")
    max_requests_per_ip: int = Field(default=256, description="Requests one client address may have in flight; "
                                     "more are answered 503 with Retry-After at once (behind a reverse proxy every "
                                     "client has the proxy's address: see the README).")
    max_requests: int | None = Field(default=None, description="Requests in flight from all addresses; more are "
                                     "answered 503 with Retry-After at once (default: a quarter of the connections "
                                     "the descriptor limit allows).")
    max_connections_per_ip: int = Field(default=2048, description="Open connections one client address may hold; "
                                        "more are closed at once, unanswered (the hard cap, well above "
                                        "--max-requests-per-ip).")
    data_dir: Path = Field(default=Path("artisan-data"), description="Where runs, checkpoints and logs live.")
    cache_dir: Path = Field(default=DEFAULT_CACHE, description="Where dequantised GGUF models are kept.")
    engine: Literal["torch", "vllm"] = Field(default="torch", description="torch (default; CPU or CUDA) or vllm (a "
                                             "vLLM server process beside art-server; see server/engine/vllm.py).")
    device: str = Field(default="auto", description="auto, cpu or cuda")
    dtype: str = Field(default="auto", description="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or "
                       "float16")
    gradient_checkpointing: bool = Field(default=False, description="Recompute activations in the backward pass: less "
                                         "memory for long sequences, about a third more time.")
    share_prefix: bool = Field(default=True, description="Train the sequences that share a prefix (a group's prompt, a "
                               "history's first turns) in one row, the prefix encoded once: the same loss and "
                               "gradients, fewer tokens (server/training/packing.py).")
    decode_copy: bool = Field(default=True, description="Where the torch engine decodes in float32 on a CPU, keep a "
                              "transposed copy of the linear weights: one sequence decodes about 20% faster, for the "
                              "weights' size again in memory (server/model/decode_copy.py).")
    # server/training/memory.py applies it.
    memory_budget: float | None = Field(default=None, description="GB a training step may take art-server to "
                                        "(weights, caches and the step's activations); micro-batches are cut to fit, "
                                        "and a step whose longest sequence cannot is refused (default: its own use "
                                        "plus 90% of what the machine has available when the step starts).")
    # --engine vllm: the vLLM server process art-server starts beside itself (server/engine/vllm.py).
    vllm_python: str | None = Field(default=None, description="--engine vllm: the Python with vllm installed "
                                    "(default: this one).")
    vllm_gpu_memory_utilization: float = Field(default=0.45, description="--engine vllm: its share of the GPU's "
                                               "memory; the trainer needs the rest.")
    vllm_max_lora_rank: int = Field(default=64, description="--engine vllm: the largest LoRA rank a run may use.")
    # More adapters than this stay cached and swap in.
    vllm_max_loras: int = Field(default=8, description="--engine vllm: adapters decoded in one batch.")
    vllm_start_timeout: float = Field(default=900.0, description="--engine vllm: seconds the vLLM server may take to "
                                      "start.")
    # Past one machine on Ray (server/engine/replicas.py, server/training/data_parallel.py).
    replicas: int = Field(default=1, description="Engine replicas, each a Ray actor with the base model and the runs' "
                          "adapters, behind this one API (more than 1 needs Ray: the `ray` extra).")
    train_processes: int = Field(default=1, description="Data-parallel training processes (Ray actors; gloo on CPU, "
                                 "NCCL on GPU): a step's micro-batches are split among them.")
    ray_address: str | None = Field(default=None, description="The Ray cluster for --replicas and --train-processes "
                                    "(default: a local one).")
    max_batch: int = Field(default=64, description="Sequences decoded together.")
    max_waiting: int = Field(default=512, description="Sequences queued before requests get 503.")
    prefix_cache_mb: int = Field(default=1024, description="MiB of recent long prompts' K/V (the torch engine) that a "
                                 "prompt opening the same way reuses instead of prefilling again (0: off).")
    prefix_state_every: int = Field(default=1024, ge=0, description="Where a model's layers keep states (Qwen3.5's "
                                    "linear attention), the prefix cache keeps them every this many tokens of a "
                                    "prefill, so a prompt sharing only its opening resumes there (0: only at a "
                                    "prompt's end).")
    kv_cache_mb: int | None = Field(default=None, description="MiB the torch engine's running rows may hold in K/V; "
                                    "a row that would take the batch past it waits for rows to finish (rows that "
                                    "join copy the batch once, so it may briefly take twice this). Default: an "
                                    "eighth of the memory the device has available when the server starts, at least "
                                    "2048.")
    max_request_bytes: int = Field(default=64 * 1024 * 1024, description="Larger request bodies get 413.")
    # Sessions recorded by the server (server/harness/sessions.py) and responses kept for previous_response_id.
    session_ttl: float = Field(default=3600.0, description="Seconds a recorded session lives unused, and a kept "
                               "response (for previous_response_id and retrieval) lives.")
    max_sessions: int = Field(default=10_000, description="Recorded sessions live at once; a new one past it gets a "
                              "429.")
    session_max_exchanges: int = Field(default=1_000, description="Exchanges one recorded session may hold.")
    session_max_tokens: int = Field(default=2_000_000, description="Tokens one recorded session may hold.")
    # Below max_sessions, so that one key recording (or failing) in bulk cannot lock the other keys out.
    max_sessions_per_key: int = Field(default=1_000, description="Recorded sessions one API key may have live at "
                                      "once; a new one past it gets a 429.")
    session_max_bytes: int = Field(default=64 * 1024 * 1024, description="Bytes one recorded session may hold (its "
                                   "exchanges as JSON, fields no chat template reads left out); past it, a 409.")
    job_time_limit: float = Field(default=6 * 3600.0, description="Seconds a training job may run before it is "
                                  "stopped.")
    # Bounds that keep one run from holding the others (server/training/bounds.py).
    max_job_optimizer_steps: int | None = Field(default=1024, description="Optimizer steps (epochs x minibatches) one "
                                                "training job may take; larger jobs are refused at submission, so "
                                                "that one run's job never holds the others' for long (runs take "
                                                "turns).")
    adapter_memory_mb: int | None = Field(default=None, description="MiB all runs' adapters, optimizer states and "
                                          "served copies may take together; a run past it is refused (default: what "
                                          "the device has left, less --memory-reserve-mb).")
    memory_reserve_mb: int = Field(default=1024, description="MiB kept free for decoding and training: a new run "
                                   "whose adapter would eat into it is refused.")
    keep_trajectory_steps: int | None = Field(default=None, description="Keep trajectories of only the newest N steps "
                                              "per run (step metrics are always kept). Default: keep all.")
    # Trajectory exporters (exporters/, queued by server/export_queue.py); off when empty.
    export: list[str] = Field(default=[], description="Send trajectories to langfuse, weave or openpipe (repeat, or "
                              "comma-separate); each reads its keys from its own environment variables (see "
                              "exporters/).")
    export_timeout: float = Field(default=10.0, description="Seconds an exporter's request may take before it counts "
                                  "as failed.")
    export_queue: int = Field(default=16, description="Batches (steps) an exporter may have waiting; more are dropped "
                              "and counted.")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(settings: Settings) -> None:
    """A server that trains on what it is sent must not listen to the world unauthenticated."""
    if not is_loopback(settings.host) and not settings.api_key and not settings.tenant_keys:
        raise SystemExit(f"refusing to bind {settings.host} without an API key: pass --api-key or set ARTISAN_API_KEY")
