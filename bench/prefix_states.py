"""Tasks behind one long system prompt, on a model whose layers keep states (Qwen3.5's linear attention).

Starts art-server on a random Qwen3.5-style model (three linear-attention layers to each full-attention
one; speed does not depend on what it says) twice in one run: with the prefix cache keeping the
layers' states every `--prefix-state-every` tokens of a prefill (its default), and with 0, the baseline,
where a state is kept only at a prompt's end, so a task that shares only the system prompt with the
one before prefills from scratch. Each sends `--tasks` tasks one after another, the same system prompt
of about `--system-tokens` tokens and a question of its own, one token each, and times each answer;
`speedup` is over the answers after the first. `python bench/prefix_states.py`; one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import typer

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.local_server import LocalServer  # noqa: E402

SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
             linear_key_head_dim=64, linear_value_head_dim=64)


def build_model(out: Path, context: int) -> Path:
    import torch
    import transformers

    from examples.demo.pretrain import build_tokenizer

    tok = build_tokenizer()
    tok.save_pretrained(out)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=len(tok), max_position_embeddings=context, tie_word_embeddings=True,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id, **SHAPE)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    (out / "artisan.json").write_text(json.dumps({"name": "bench"}))
    return out


async def _tasks(url: str, system: str, tasks: int) -> list[float]:
    """Seconds to each task's answer (the first fills the cache; it stops at every state kept)."""
    from openai import AsyncOpenAI

    seconds = []
    async with AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=1800) as client:
        for i in range(tasks):
            started = time.perf_counter()
            await client.chat.completions.create(model="bench", max_tokens=1, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": f"Task {i}: what is {i} + {i}?"}])
            seconds.append(time.perf_counter() - started)
    return seconds


def main(tasks: int = typer.Option(4, help="Tasks sent one after another (the first fills the cache)."),
         system_tokens: int = typer.Option(6000, help="About how long the shared system prompt is.")) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-prefix-states-") as work:
        model_dir = build_model(Path(work) / "model", context=2 * system_tokens)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        sentence = "Follow the airline's policy: verify the user, then act on one reservation at a time. "
        system = sentence * max(1, system_tokens // len(tok.encode(sentence)))
        out = {"bench": "prefix_states", "system_tokens": len(tok.encode(system)), "tasks": tasks, "shape": SHAPE}
        for label, every in (("kept", None), ("baseline", "0")):
            extra = ["--device", "cpu"] + ([] if every is None else ["--prefix-state-every", every])
            server = LocalServer(Path(work) / f"data-{label}", model=model_dir, extra=extra).start(timeout=900)
            try:
                first, *seconds = asyncio.run(_tasks(server.url, system, tasks))
                out[f"{label}_first_seconds"] = round(first, 3)
                out[f"{label}_seconds"] = [round(s, 3) for s in seconds]
                out[f"{label}_prefix_cache"] = httpx.get(server.url + "/health").json()["prefix_cache"]
            finally:
                server.stop()
        out["speedup"] = round(sum(out["baseline_seconds"]) / sum(out["kept_seconds"]), 2)
        print(json.dumps(out))


if __name__ == "__main__":
    typer.run(main)
