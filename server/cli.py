"""`art-server`: serve a base model and its runs' LoRAs, and train them."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import typer

from server.settings import DEFAULT_MODEL_DIR, Settings, check_bind

# torch's OpenMP threads spin while they wait for work; beside another busy process (a client,
# a test, a second server) that spinning starves everyone and decoding slows ~50x on 2 cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

app = typer.Typer(add_completion=False, help=__doc__)


@app.command()
def serve(
    model: Path = typer.Option(DEFAULT_MODEL_DIR, help="A local Hugging Face model directory (default: the embedded tiny model)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind. A non-loopback address needs an API key."),
    port: int = typer.Option(8000),
    api_key: str = typer.Option(None, envvar="ARTISAN_API_KEY", help="Bearer key required on every route but /health."),
    data_dir: Path = typer.Option(Path("artisan-data"), help="Where runs, checkpoints and logs live."),
    device: str = typer.Option("auto", help="auto, cpu or cuda"),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16 or float16"),
    max_batch: int = typer.Option(64, help="Sequences decoded together."),
    max_waiting: int = typer.Option(512, help="Sequences queued before requests get 503."),
    max_request_bytes: int = typer.Option(64 * 1024 * 1024, help="Larger request bodies get 413."),
    keep_trajectory_steps: int = typer.Option(None, help="Keep trajectories of only the newest N steps per run "
                                                         "(step metrics are always kept). Default: keep all."),
    export: list[str] = typer.Option([], "--export", envvar="ARTISAN_EXPORT",
                                     help="Send trajectories to langfuse, weave or openpipe (repeat, or comma-separate); "
                                          "each reads its keys from its own environment variables (see server/export)."),
    export_timeout: float = typer.Option(10.0, help="Seconds an exporter's request may take before it counts as failed."),
    export_queue: int = typer.Option(16, help="Batches (steps) an exporter may have waiting; more are dropped and counted."),
    log_level: str = typer.Option("info"),
) -> None:
    import uvicorn

    from server.app import create_app

    settings = Settings(model=model, host=host, port=port, api_key=api_key or None, data_dir=data_dir,
                        device=device, dtype=dtype, max_batch=max_batch, max_waiting=max_waiting,
                        max_request_bytes=max_request_bytes,
                        export=export, export_timeout=export_timeout, export_queue=export_queue,
                        keep_trajectory_steps=keep_trajectory_steps)
    check_bind(settings)
    if not settings.model.exists():
        raise SystemExit(f"model directory {settings.model} does not exist")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings), host=host, port=port, log_level=log_level, timeout_keep_alive=30)


if __name__ == "__main__":
    app()
