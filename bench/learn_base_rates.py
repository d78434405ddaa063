"""SmolLM2's base accuracy on easy reasoning-gym settings, per system prompt: how bench/learn.py's
task was chosen (a base rate between 5% and 50%, so GRPO groups have signal and room to improve).

Plain chat completions against a running art-server (its base model, no adapter):

    python bench/learn_base_rates.py http://127.0.0.1:8000 [--model NAME] [--n 48]

--model defaults to the first model the server lists (its base model).

Prints one JSON line per (task, prompt), then the table as one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai  # noqa: E402

from examples import reasoning_gym as learn_task  # noqa: E402


async def main(url: str, model: str | None, n: int, temperature: float, max_tokens: int, tasks: list[str],
               prompts: list[str], seed: int) -> None:
    client = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="x", max_retries=2, timeout=900)
    # A served name is the GGUF's stem (SmolLM2-135M-Instruct.Q4_1), which no one types from memory.
    model = model or (await client.models.list()).data[0].id
    limit = asyncio.Semaphore(32)

    async def one(i, row, prompt):
        async with limit:  # each question's sample seeded, so a rerun gives the same table
            r = await client.chat.completions.create(model=model, temperature=temperature, max_tokens=max_tokens,
                                                     messages=learn_task.messages(row, prompt), seed=seed + i)
        reply = r.choices[0].message.content or ""
        return learn_task.score(reply, row), reply

    table = []
    for task in tasks:
        rows = learn_task.rows(task, n, learn_task.EVAL_SEED)
        for prompt in prompts:
            res = await asyncio.gather(*(one(i, r, prompt) for i, r in enumerate(rows)))
            line = {"task": task, "prompt": prompt, "n": n, "mean_score": round(sum(s for s, _ in res) / n, 3),
                    "exact": round(sum(s >= 1.0 for s, _ in res) / n, 3),
                    "samples": [[rows[i]["answer"], res[i][1][:40]] for i in range(3)]}
            print(json.dumps(line), flush=True)
            table.append({k: line[k] for k in ("task", "prompt", "mean_score", "exact")})
    print(json.dumps({"temperature": temperature, "max_tokens": max_tokens, "n": n, "seed": seed, "table": table}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--model", help="a served model name (default: the first the server lists)")
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0, help="question i is sampled with seed + i")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--tasks", nargs="*", default=list(learn_task.SETTINGS))
    ap.add_argument("--prompts", nargs="*", default=list(learn_task.PROMPTS))
    a = ap.parse_args()
    asyncio.run(main(a.url, a.model, a.n, a.temperature, a.max_tokens, a.tasks, a.prompts, a.seed))
