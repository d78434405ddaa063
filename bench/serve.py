"""Serving throughput through the HTTP server vs an in-process padded static batch.

Builds a ~20M-parameter model (random weights: speed does not depend on what it says), starts
art-server on it, and measures generated tokens per second at 1, 8 and 32 concurrent clients.
The baseline, measured in the same run on the same machine, is transformers' `generate` on one
padded batch of 32 prompts with the same token counts (`roofline_c32`).

    python bench/serve.py            # prints one JSON line last
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.local_server import LocalServer  # noqa: E402

MAX_TOKENS = 64
PROMPT = "Please tell me about the price and the stock of the apple, the banana and the cherry today."
MODEL_SHAPE = dict(hidden=512, layers=6, heads=8, kv_heads=2, intermediate=1408)


async def _client_load(url: str, concurrency: int, requests_per_client: int) -> float:
    """Generated tokens per second with `concurrency` clients each sending requests back to back."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    messages = [{"role": "user", "content": PROMPT}]

    async def one_client() -> int:
        tokens = 0
        for _ in range(requests_per_client):
            r = await client.chat.completions.create(model="bench", messages=messages, max_tokens=MAX_TOKENS,
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


def main() -> None:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from server.chat.format import ChatFormat
    from server.embedded.build import build_model

    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    model_dir = build_model(work / "model", **MODEL_SHAPE)
    meta = json.loads((model_dir / "artisan.json").read_text())
    (model_dir / "artisan.json").write_text(json.dumps({**meta, "name": "bench"}))
    n_params = sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values())
    prompt_ids = ChatFormat.build(AutoTokenizer.from_pretrained(model_dir)).renderer.render(
        [{"role": "user", "content": PROMPT}]).ids

    with LocalServer(work / "data", model=model_dir, extra=["--device", "cpu"]) as server:
        results = {f"throughput_c{c}": asyncio.run(_client_load(server.url, c, n)) for c, n in ((1, 4), (8, 3), (32, 2))}
    results["roofline_c32"] = _roofline(model_dir, 32, prompt_ids)
    out = {"model": f"qwen2-{n_params / 1e6:.1f}M", **{k: round(v, 1) for k, v in results.items()},
           "c32_vs_roofline": round(results["throughput_c32"] / results["roofline_c32"], 3),
           "c32_vs_c1": round(results["throughput_c32"] / results["throughput_c1"], 2),
           "prompt_tokens": len(prompt_ids), "max_tokens": MAX_TOKENS}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
