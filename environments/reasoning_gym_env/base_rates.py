"""SmolLM2's base accuracy on easy reasoning-gym settings, with the taskset's prompt and score.

Plain chat completions (no harness) against a running art-server: `python base_rates.py URL [MODEL]`.
Prints one JSON line per task: mean score (reasoning-gym gives partial credit), exact (score 1),
and how often the reply used the <answer> tags.
"""

from __future__ import annotations

import asyncio
import json
import sys

import openai
import reasoning_gym
from reasoning_gym.utils import SYSTEM_PROMPTS

from rewards.reasoning_gym import score_reply

TASKS = {
    "basic_arithmetic": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+", "-"), allow_parentheses=False, allow_negation=False),
    "chain_sum": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    "products": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    "leg_counting": dict(min_animals=1, max_animals=1, min_instances=1, max_instances=2),
    "count_bits": dict(min_n=1, max_n=16),
    "letter_counting": dict(min_words=3, max_words=5),
    "gcd": dict(min_value=1, max_value=20),
    "lcm": dict(min_value=1, max_value=10),
    "spell_backward": dict(min_word_len=3, max_word_len=4),
    "coin_flip": dict(min_trials=3, max_trials=3),
    "number_sorting": dict(min_numbers=3, max_numbers=3, min_decimals=0, max_decimals=0, min_value=0.0, max_value=20.0),
    "simple_equations": dict(min_terms=2, max_terms=2, min_value=1, max_value=10),
}

async def main(url, model):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=2, timeout=600)
    sem = asyncio.Semaphore(32)
    async def one(row):
        async with sem:
            r = await client.chat.completions.create(model=model, temperature=0.7, max_tokens=24, messages=[
                {"role": "system", "content": SYSTEM_PROMPTS["direct"]}, {"role": "user", "content": row["question"]}])
        return score_reply(r.choices[0].message.content, row), r.choices[0].message.content
    for name, opts in TASKS.items():
        rows = list(reasoning_gym.create_dataset(name, size=32, seed=0, **opts))
        res = await asyncio.gather(*(one(r) for r in rows))
        acc = sum(s for s, _ in res) / len(res)
        print(json.dumps({"task": name, "options": opts, "mean_score": acc, "exact": sum(s >= 1.0 for s, _ in res) / len(res), "tagged": sum("<answer>" in c for _, c in res) / len(res),
                          "sample": res[0][1][:60], "answer": rows[0]["answer"]}), flush=True)
asyncio.run(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "smollm2"))
