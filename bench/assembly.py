"""Assembly time of one long multi-turn trajectory against its number of turns, on the embedded
model's tokenizer and template, in-process (no server, no weights).

`assemble` is server/training/assemble.py on histories of n turns whose fingerprints are the
sampler's. The baseline, measured in the same run, renders every turn's prompt on its own, as
assembly did before it rendered the history once (quadratic in turns; measured up to
--baseline-max turns, since 2,000 took about 6 minutes). One JSON line: seconds per size, and
how each grows when the turns double (2.0 is linear, 4.0 quadratic).

    python bench/assembly.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from openai.types.chat.chat_completion import Choice  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from protocol.trajectory import History  # noqa: E402
from server.chat.format import ChatFormat  # noqa: E402
from server.chat.sampled_turns import PrefixFingerprints, fingerprint  # noqa: E402
from server.settings import DEFAULT_MODEL_DIR  # noqa: E402
from server.training.assemble import assemble_history  # noqa: E402


def history(chat: ChatFormat, turns: int) -> tuple[History, list]:
    stop = min(chat.stop_ids)
    messages: list = [{"role": "system", "content": "Answer in one word."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"word {i}?"})
        messages.append({"role": "assistant", "content": "yes", "token_ids": chat.renderer.encode("yes") + [stop]})
    whole = chat.turns.prompt(messages, None)
    prefixes = PrefixFingerprints(whole.ids)
    items = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            items.append(m)
            continue
        ids = m["token_ids"]
        items.append(Choice.model_validate({
            "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "yes"},
            "logprobs": {"content": [{"token": "t", "logprob": -0.5, "bytes": None, "top_logprobs": []} for _ in ids]},
            "token_ids": ids, "sampling": {"temperature": 1.0, "top_p": 1.0, "logprob_temperature": 1.0, "policy": "p",
                                           "step": 0, "prompt_fingerprint": prefixes.of(whole.offsets[i]),
                                           "prompt_len": 0, "model_fingerprint": "m"}}))
    return History(messages_and_choices=items), messages


def time_assembly(chat: ChatFormat, h: History) -> float:
    t0 = time.perf_counter()
    _, stats = assemble_history(h, chat)
    assert stats.prompt_mismatches == 0
    return time.perf_counter() - t0


def time_per_turn(chat: ChatFormat, messages: list) -> float:
    t0 = time.perf_counter()
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            fingerprint(chat.turns.prompt(messages[:i], None).ids)
    return time.perf_counter() - t0


def growth(seconds: dict[int, float]) -> dict[str, float]:
    sizes = sorted(seconds)
    return {f"{b}/{a}": round(seconds[b] / seconds[a], 2) for a, b in zip(sizes, sizes[1:]) if b == 2 * a}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="250,500,1000,2000,4000")
    ap.add_argument("--baseline-max", type=int, default=500)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    chat = ChatFormat.build(tok, eos_ids=[tok.eos_token_id])
    assemble, per_turn = {}, {}
    for n in map(int, args.sizes.split(",")):
        h, messages = history(chat, n)
        assemble[n] = round(min(time_assembly(chat, h) for _ in range(3)), 4)
        if n <= args.baseline_max:
            per_turn[n] = round(time_per_turn(chat, messages), 4)
    print(json.dumps({"bench": "assembly", "assemble_seconds": assemble, "assemble_growth": growth(assemble),
                      "per_turn_baseline_seconds": per_turn, "per_turn_baseline_growth": growth(per_turn)}))


if __name__ == "__main__":
    main()
