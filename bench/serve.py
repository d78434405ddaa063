"""Serving throughput through the HTTP server vs an in-process padded static batch.

Starts art-server on a model (by default a ~20M-parameter random Qwen2: speed does not depend on
what it says; `--model` takes a directory or a .gguf file) with each engine asked for, and
measures generated tokens per second at 1, 8 and 32 concurrent clients. The baseline, measured in
the same run on the same machine, is transformers' `generate` on one padded batch of 32 prompts
with the same token counts (`roofline_c32`). With the vLLM engine, vLLM's own OpenAI server is
measured too, alone, with the same requests (`vllm_direct_*`): what art-server's hop costs.

    python bench/serve.py                                   # the random Qwen2, torch engine
    python bench/serve.py --model DIR --engine torch --engine vllm --vllm-python .venv-vllm/bin/python

Prints one JSON line last.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.local_server import LocalServer  # noqa: E402

MAX_TOKENS = 64
PROMPT = "Please tell me about the price and the stock of the apple, the banana and the cherry today."
MODEL_SHAPE = dict(hidden=512, layers=6, heads=8, kv_heads=2, intermediate=1408)
LOADS = ((1, 4), (8, 3), (32, 2))  # (concurrent clients, requests each)


async def _client_load(url: str, model: str, concurrency: int, requests_per_client: int,
                       max_tokens: int = MAX_TOKENS) -> float:
    """Generated tokens per second with `concurrency` clients each sending requests back to back."""
    from openai import AsyncOpenAI

    messages = [{"role": "user", "content": PROMPT}]
    async with AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=1800) as client:
        async def one_client() -> int:
            tokens = 0
            for _ in range(requests_per_client):
                r = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                         temperature=1.0, extra_body={"ignore_eos": True})
                tokens += r.usage.completion_tokens
            return tokens

        await one_client()  # warm-up
        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one_client() for _ in range(concurrency))))
        return tokens / (time.perf_counter() - started)


def _roofline(model_dir: Path, batch: int, prompt_ids: list[int]) -> float:
    """transformers generate on one padded batch (all prompts equal, so no padding is wasted)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids] * batch)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
              max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:2], **{**kw, "attention_mask": torch.ones_like(ids[:2]), "max_new_tokens": 4,
                                   "min_new_tokens": 4})  # warm-up
        best = 0.0
        for _ in range(2):
            started = time.perf_counter()
            out = model.generate(ids, **kw)
            best = max(best, (out.shape[1] - ids.shape[1]) * batch / (time.perf_counter() - started))
    return best


def _model(model: str | None, work: Path) -> tuple[Path, str]:
    """A model directory and a name for it in the output."""
    from safetensors.torch import load_file

    from examples.demo.pretrain import build_model
    from server.model.source import resolve
    from server.settings import DEFAULT_CACHE

    if model:
        path = resolve(model, DEFAULT_CACHE / "models")
        return path, Path(model).stem
    path = build_model(work / "model", **MODEL_SHAPE)
    n_params = sum(t.numel() for t in load_file(str(path / "model.safetensors")).values())
    return path, f"qwen2-{n_params / 1e6:.1f}M"


def _vllm_direct(model_dir: Path, work: Path, python: str | None) -> dict[str, float]:
    """vLLM's own chat route, as art-server's vLLM engine starts it, with the same loads."""
    from transformers import AutoConfig

    from server.engine.vllm_process import BASE_NAME, VllmServer
    from server.model.host import context_window
    from server.settings import Settings

    settings = Settings(vllm_python=python, data_dir=work / "vllm-direct")
    window = context_window(AutoConfig.from_pretrained(model_dir))
    server = VllmServer.for_settings(settings, model_dir, "float32", window, on_gpu=False)
    server.start(timeout=900)
    try:
        return {f"vllm_direct_c{c}": round(asyncio.run(_client_load(server.url, BASE_NAME, c, n)), 1)
                for c, n in LOADS}
    finally:
        server.stop()


def measure(model: str | None, engine: list[str], vllm_python: str | None, work: Path) -> dict:
    from transformers import AutoTokenizer

    from server.chat.format import ChatFormat

    model_dir, label = _model(model, work)
    prompt_ids = ChatFormat.build(AutoTokenizer.from_pretrained(model_dir)).renderer.render(
        [{"role": "user", "content": PROMPT}]).ids
    out: dict = {"model": label, "prompt_tokens": len(prompt_ids), "max_tokens": MAX_TOKENS}
    for name in engine:
        extra = ["--device", "cpu", "--served-model-name", "bench", "--engine", name]
        if name == "vllm" and vllm_python:
            extra += ["--vllm-python", vllm_python]
        server = LocalServer(work / f"data-{name}", model=model_dir, extra=extra).start(timeout=900)
        try:
            for c, n in LOADS:
                out[f"{name}_c{c}"] = round(asyncio.run(_client_load(server.url, "bench", c, n)), 1)
        finally:
            server.stop()
        if name == "vllm":
            out.update(_vllm_direct(model_dir, work, vllm_python))
    out["roofline_c32"] = round(_roofline(model_dir, 32, prompt_ids), 1)
    if "vllm" in engine:
        out["vllm_engine_vs_direct_c1"] = round(out["vllm_c1"] / out["vllm_direct_c1"], 3)
        out["vllm_engine_vs_direct_c32"] = round(out["vllm_c32"] / out["vllm_direct_c32"], 3)
    for name in engine:
        out[f"{name}_c32_vs_roofline"] = round(out[f"{name}_c32"] / out["roofline_c32"], 3)
        out[f"{name}_c32_vs_c1"] = round(out[f"{name}_c32"] / out[f"{name}_c1"], 2)
    return out


def main(model: str = typer.Option(None, help="A model directory or .gguf file (default: a random 20M Qwen2)."),
         engine: list[str] = typer.Option(["torch"], help="torch and/or vllm (repeat to compare in one run)."),
         vllm_python: str = typer.Option(None, help="The Python with vllm installed (default: this one).")) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as work:
        print(json.dumps(measure(model, engine, vllm_python, Path(work))))


if __name__ == "__main__":
    typer.run(main)
