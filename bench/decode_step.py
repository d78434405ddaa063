"""The torch engine's decode step in process: the model's forward against the decode pass.

On SmolLM2-135M (the test models' GGUF, as art-server decodes it on a CPU: float32, the transposed
copy for one row), one decode step of 1 and 8 rows after a 100-token prompt, under the base model
and under a LoRA adapter (what every RL rollout decodes with), through transformers' and peft's
forward (the baseline, in the same run) and through server/model/decode_pass.py. Steps alternate
between the two, so a slower minute of the machine slows both. Also says whether the two gave the
same bits. Few rows run on the engine's thread alone, as the engine runs them.

    python bench/decode_step.py            # `make bench-decode`

Prints one JSON line last.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from peft import LoraConfig  # noqa: E402

from server.engine.kv_cache import HEADROOM, BatchKV  # noqa: E402
from server.engine.torch_engine import FEW_ROWS  # noqa: E402
from server.model import decode_copy  # noqa: E402
from server.model.host import ModelHost  # noqa: E402
from server.model.threads import own_threads  # noqa: E402
from tests.real_models import converted, smollm2_gguf  # noqa: E402

PROMPT_TOKENS, STEPS, ROUNDS = 100, 16, 3


def _steps(host: ModelHost, adapters: list[str | None], through_pass: bool) -> tuple[float, list[torch.Tensor]]:
    """Seconds per decode step over STEPS steps after a prefill, and the logits each gave."""
    cfg = host.config
    rows = len(adapters)
    kv = BatchKV.empty(cfg.num_hidden_layers, rows, cfg.num_key_value_heads, cfg.head_dim,
                       PROMPT_TOKENS + HEADROOM, host.dtype, host.device)
    prompt = torch.randint(0, 1000, (rows, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    host.decode(prompt, adapters, past_key_values=kv.cache(), use_cache=True, attention_mask=torch.ones_like(prompt),
                logits_to_keep=1)
    kv.advance(PROMPT_TOKENS)
    host.exact_decode_pass = through_pass
    token, seen = torch.full((rows, 1), 5), []
    started = time.perf_counter()
    for _ in range(STEPS):
        logits = host.decode_step(token, adapters, kv.cache(), kv.attention_mask(extra=1),
                                  torch.tensor(kv.lengths)[:, None])
        kv.advance(1)
        seen.append(logits)
        token = logits.argmax(-1, keepdim=True)
    return (time.perf_counter() - started) / STEPS, seen


def main() -> None:
    host = ModelHost(converted(smollm2_gguf()), device="cpu", dtype="float32")
    decode_copy.copy_for_decode(host.base_model)
    host.add_adapter("run", LoraConfig(r=8, lora_alpha=16, target_modules=host.lora_targets, lora_dropout=0.0))
    with torch.no_grad():
        for p in host.adapter_params("run"):  # a trained adapter's B is not zero
            p.normal_(0, 0.02)
    knows = host.exact_decode_pass
    out: dict = {"model": "SmolLM2-135M-Instruct fp32", "prompt_tokens": PROMPT_TOKENS, "decode_pass_applies": knows,
                 "same_bits": True}
    with torch.inference_mode():
        for policy in ("base", "lora"):
            for rows in (1, 8):
                adapters = [None if policy == "base" else "run"] * rows
                times: dict[bool, list[float]] = {False: [], True: []}
                with own_threads(1 if rows <= FEW_ROWS else None):
                    _steps(host, adapters, True)  # warm-up
                    for _ in range(ROUNDS):
                        for through_pass in (False, True):
                            seconds, seen = _steps(host, adapters, through_pass)
                            times[through_pass].append(seconds)
                            if not through_pass:
                                want = seen
                            else:
                                out["same_bits"] &= all(torch.equal(a, b) for a, b in zip(want, seen))
                forward_ms, pass_ms = (1000 * statistics.median(times[k]) for k in (False, True))
                key = f"{policy}_r{rows}"
                out[f"{key}_forward_ms"], out[f"{key}_pass_ms"] = round(forward_ms, 2), round(pass_ms, 2)
                out[f"{key}_speedup"] = round(forward_ms / pass_ms, 3)
    host.exact_decode_pass = knows
    print(json.dumps(out))


if __name__ == "__main__":
    main()
