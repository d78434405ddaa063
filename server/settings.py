"""Server settings and the bind check: importable without torch, so the CLI refuses a bad
configuration at once."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

DEFAULT_MODEL_DIR = Path(__file__).parent / "embedded" / "model"
REPLICAS_ARE_TORCH = "--replicas runs torch engines on Ray; with --engine vllm, leave --replicas at 1"
DEFAULT_CACHE = Path(os.environ.get("ARTISAN_CACHE", Path.home() / ".cache" / "artisan"))


class Settings(BaseModel):
    # A model directory, a Hugging Face hub id, or a .gguf file (server/model_source.py).
    model: str = str(DEFAULT_MODEL_DIR)
    served_model_name: list[str] = []  # names the base model answers to; the first is its served name
    chat_template: Path | None = None  # Jinja file overriding the tokenizer's template
    chat_template_kwargs: dict[str, Any] = {}
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    # Serve `tools` to a template that does not render them (the model never sees them) instead of a 400.
    allow_unrendered_tools: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # admin keys (comma-separated): every run is theirs to see
    # Tenant keys, name -> key (--tenant-keys FILE): each sees only the runs it created.
    tenant_keys: dict[str, str] = {}
    max_runs_per_key: int = 100  # runs one key (a tenant, or the admin keys together) may create
    # Seconds a connection may take to send a request's headers before it is closed (server/connections.py).
    header_timeout: float = 10.0
    data_dir: Path = Path("artisan-data")
    cache_dir: Path = DEFAULT_CACHE  # dequantised GGUF models
    engine: Literal["torch", "vllm"] = "torch"
    device: str = "auto"
    dtype: str = "auto"
    gradient_checkpointing: bool = False
    # GB a training step may take the process to; None: its own use plus 90% of what the machine has
    # available (server/training/memory.py).
    memory_budget: float | None = None
    # --engine vllm: the vLLM server process art-server starts beside itself (server/engine/vllm.py)
    vllm_python: str | None = None  # the Python that has vllm installed (default: art-server's own)
    vllm_gpu_memory_utilization: float = 0.45  # vLLM's share of the GPU; the trainer uses the rest
    vllm_max_lora_rank: int = 64
    vllm_max_loras: int = 8  # adapters decoded in one batch; more stay cached and swap in
    vllm_start_timeout: float = 900.0
    # Past one machine on Ray (server/engine/replicas.py, server/training/data_parallel.py): engine
    # replicas and training processes as Ray actors on the cluster at `ray_address` (None with more
    # than one of either: a local Ray started by the server).
    replicas: int = 1
    train_processes: int = 1
    ray_address: str | None = None
    max_batch: int = 64
    max_waiting: int = 512
    prefix_cache_mb: int = 1024
    max_request_bytes: int = 64 * 1024 * 1024
    # Sessions recorded by the server (server/sessions.py) and responses kept for previous_response_id:
    # dropped after this many seconds unused; a session holds at most so many exchanges and tokens.
    session_ttl: float = 3600.0
    max_sessions: int = 10_000
    session_max_exchanges: int = 1_000
    session_max_tokens: int = 2_000_000
    job_time_limit: float = 6 * 3600.0  # seconds a training job may run before it is stopped
    # Bounds that keep one run from holding the others (server/training/bounds.py): optimizer steps
    # per job (None: unbounded); the memory all runs' adapters may take (None: what the device has
    # left), and the memory kept free for decoding and training.
    max_job_optimizer_steps: int | None = 1024
    adapter_memory_mb: int | None = None
    memory_reserve_mb: int = 1024
    # Retention: trajectories of only the newest N steps per run are kept (None: all of them).
    keep_trajectory_steps: int | None = None
    # Optional trajectory exporters (exporters/, queued by server/export_queue.py): langfuse, weave, openpipe; off when empty.
    export: list[str] = []
    export_timeout: float = 10.0
    export_queue: int = 16


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
