"""Server settings and the bind check: importable without torch, so the CLI refuses a bad
configuration at once."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import BaseModel

DEFAULT_MODEL_DIR = Path(__file__).parent / "embedded" / "model"


class Settings(BaseModel):
    model: Path = DEFAULT_MODEL_DIR
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    data_dir: Path = Path("artisan-data")
    device: str = "auto"
    dtype: str = "auto"
    max_batch: int = 64
    max_waiting: int = 512
    max_request_bytes: int = 64 * 1024 * 1024
    # Retention: trajectories of only the newest N steps per run are kept (None: all of them).
    keep_trajectory_steps: int | None = None
    # Optional trajectory exporters (server/export): langfuse, weave, openpipe; off when empty.
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
    if not is_loopback(settings.host) and not settings.api_key:
        raise SystemExit(f"refusing to bind {settings.host} without an API key: pass --api-key or set ARTISAN_API_KEY")
