"""`art-server`: serve a base model and its runs' LoRAs, and train them."""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from server.app import DEFAULT_MODEL_DIR, Settings, check_bind

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
    log_level: str = typer.Option("info"),
) -> None:
    import uvicorn

    from server.app import create_app

    settings = Settings(model=model, host=host, port=port, api_key=api_key or None, data_dir=data_dir,
                        device=device, dtype=dtype, max_batch=max_batch, max_waiting=max_waiting)
    check_bind(settings)
    if not settings.model.exists():
        raise SystemExit(f"model directory {settings.model} does not exist")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings), host=host, port=port, log_level=log_level, timeout_keep_alive=30)


if __name__ == "__main__":
    app()
