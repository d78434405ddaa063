"""TRL's side of the tool-agent comparison (bench/tool_agent.py), and the held-out measure both
trainers are judged by.

- `run_trl`: TRL 1.16's GRPOTrainer with its own tool loop on examples/leg_lookup, from artisan's
  warm start exported as PEFT (bench/trl_agents.export_peft), its config set to artisan's step
  wherever TRL has the knob (bench/learn.py's terms).
- `greedy_episodes`: bench/trl_agents.greedy_episodes on held-out rows; the reward is LegLookupEnv.score's.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples import leg_lookup  # noqa: E402
from rollouts.env import Score  # noqa: E402
from learn import (ADAM_BETAS, ADAM_EPS, EPS_HIGH, EPS_LOW, LORA_ALPHA, LORA_RANK,  # noqa: E402
                   LORA_TARGETS, MAX_GRAD_NORM)
import trl_agents  # noqa: E402
from trl_agents import saving_callback, threads, trl_tool, trl_tokenizer  # noqa: E402

# Every term in which TRL's tool rollout differs from artisan's agent loop (rollouts/agent.py
# through art-server), beyond bench/learn.py's DIFFERENCES for the GRPO step itself.
DIFFERENCES = {
    "turn_budget": "artisan: max_tokens per turn, and a turn cut there ends the episode (stop max_tokens); TRL: "
                   "max_new_tokens per turn set to the same (generation_kwargs), a cut turn is parsed like any "
                   "other, and a budget for the whole episode (max_completion_length, prompt excluded, tool results "
                   "included) past which a round's tool results are dropped and the episode ends",
    "turns": "artisan: max_turns model turns, the tools of the last one still run; TRL: "
             "max_tool_calling_iterations = max_turns - 1 tool rounds, the last turn's calls are not run. Either "
             "way an episode whose last turn calls a tool ends without an answer and scores 0",
    "stop_tokens": "artisan stops a turn at the generation config's EOS ids, the tokenizer's EOS and the "
                   "template's end-of-turn token; TRL at the generation config's EOS ids and the tokenizer's EOS "
                   "(SmolLM2 and the embedded model: both <|im_end|> alone)",
    "call_parsing": "artisan: art-server's hermes parser (a <tool_call> that does not parse leaves the whole text "
                    "as the answer, stop malformed_tool_call); TRL: transformers' parse_response with TRL's "
                    "qwen3_template (a turn that does not parse is decoded whole as the answer too, without "
                    "special tokens); both take JSON {name, arguments} between the tags",
    "tool_errors": "a ToolError is 'Error: <message>' in both; a call to an unknown tool or with other argument "
                   "names is the environment's ToolError text in artisan ('Error: unknown tool ...', a missing "
                   "argument read as '') but TRL's own str({'error': ...}) (\"Tool x not found.\", Python's "
                   "TypeError for an unexpected keyword)",
    "tool_message": "artisan's tool messages carry tool_call_id, TRL's the tool's name; the template reads "
                    "neither, so both render <|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>",
    "token_continuity": "both continue an episode from the sampled ids (art-server splices each turn's ids into "
                        "the next prompt; TRL concatenates prompt + completion + the template's tool suffix); the "
                        "tool results and the next generation prompt are masked out of the loss in both",
    "tool_schema": "artisan sends examples.leg_lookup.TOOLS; TRL builds its schema from the wrappers' signatures "
                   "and docstrings, with the same names, parameters and descriptions, so the template renders the "
                   "same system turn",
}
# TRL's whole-episode budget, per turn: a turn's own tokens plus its tool results (a lookup's
# result is about 20 tokens of tags). Generous, because tokens past the real episode cost nothing
# (TRL pads to the batch's longest) and a budget that binds drops tool results without a word.
EPISODE_TOKENS_PER_TURN_FACTOR = 2
EPISODES_PER_PASS = 2  # TRL's micro-batch (per_device_train_batch_size): its memory, not its gradient


TRL_TOOLS = [trl_tool(spec, getattr(leg_lookup, spec["function"]["name"])) for spec in leg_lookup.TOOLS]


def reward(row: dict[str, Any], completion: list[dict[str, Any]]) -> float:
    """LegLookupEnv.score's reward for one TRL episode: the opening plus TRL's completion messages."""
    env = leg_lookup.LegLookupEnv(row)
    return asyncio.run(env.score([*leg_lookup.opening(row), *completion])).reward


# ---- TRL ----------------------------------------------------------------------------------------

def _check_lora(adapter: Path) -> None:
    """The start adapter has the LoRA both trainers are compared with (bench/learn.py's settings):
    a warm start registered otherwise would make the comparison one of two different adapters."""
    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    found = (config["r"], float(config["lora_alpha"]), sorted(config["target_modules"]))
    wanted = (LORA_RANK, float(LORA_ALPHA), sorted(LORA_TARGETS))
    if found != wanted:
        raise ValueError(f"{adapter}: LoRA (rank, alpha, targets) {found}, the comparison's are {wanted}")


def run_trl(model_dir: Path, start_adapter: Path, train_rows: list[dict], *, steps: int, prompts_per_step: int,
            group_size: int, learning_rate: float, temperature: float, max_turns: int, max_tokens_per_turn: int,
            seed: int, out: Path, save_every: int, budget_seconds: float | None,
            train_episodes: Path | None = None) -> list[dict]:
    """GRPO with TRL's tool loop from `start_adapter`, on `train_rows` in order, prompts_per_step x
    group_size episodes per optimizer step. The adapter is saved to out/step-N every `save_every`
    steps and at the last step (`steps`, or the first step whose training seconds pass
    `budget_seconds`). One {"step", "train_seconds", "adapter"} per saved step, train_seconds
    counting from the start of training and leaving the saving out. Each sampled episode is
    appended to `train_episodes` (JSON lines: step, question, reward, TRL's completion messages):
    TRL's batches beside artisan's trajectories on the same questions."""
    import torch
    from datasets import Dataset
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    _check_lora(start_adapter)
    threads()
    out = Path(out)
    tokenizer = trl_tokenizer(model_dir, leg_lookup.CHAT_TEMPLATE.read_text())  # what art-server is given for it
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(start_adapter), is_trainable=True)
    used = train_rows[:steps * prompts_per_step]
    dataset = Dataset.from_list([{"prompt": leg_lookup.opening(r), "row": i} for i, r in enumerate(used)])
    episodes = prompts_per_step * group_size
    per_pass = math.gcd(episodes, EPISODES_PER_PASS)  # the passes must add up to the step's episodes

    def leg_reward(prompts, completions, row, **_):
        rewards = [reward(used[i], c) for c, i in zip(completions, row)]
        if train_episodes is not None:
            keep_train_episodes(train_episodes, [used[i] for i in row], [i // prompts_per_step + 1 for i in row],
                                completions, rewards)
        return rewards

    config = GRPOConfig(
        output_dir=str(out / "trl"), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        # EPISODES_PER_PASS episodes per forward and backward, accumulated into one optimizer step
        # (TRL still generates the step's episodes at once). Without gradient checkpointing the
        # activations of episodes padded to ~1,500 tokens are the memory: all 32 of a 4 x 8 step in
        # one pass were killed at 24 GB, and 8 a pass peaked at 22.7 GB.
        per_device_train_batch_size=per_pass, gradient_accumulation_steps=episodes // per_pass,
        num_generations=group_size, max_steps=steps, num_iterations=1,
        max_completion_length=EPISODE_TOKENS_PER_TURN_FACTOR * max_turns * max_tokens_per_turn,
        generation_kwargs={"max_new_tokens": max_tokens_per_turn},  # per turn, as artisan's max_tokens
        max_tool_calling_iterations=max_turns - 1,  # tool rounds: max_turns generations in all
        learning_rate=learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=ADAM_BETAS[0], adam_beta2=ADAM_BETAS[1], adam_epsilon=ADAM_EPS, max_grad_norm=MAX_GRAD_NORM,
        temperature=temperature, top_p=1.0, top_k=0, repetition_penalty=1.0,
        beta=0.0, epsilon=EPS_LOW, epsilon_high=EPS_HIGH, loss_type="dapo", scale_rewards="none",
        mask_truncated_completions=False, shuffle_dataset=False, seed=seed,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)

    saved: list[dict] = []

    class Progress(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                print(f"trl step {state.global_step}: reward {logs['reward']:.3f} tool calls/episode "
                      f"{logs.get('tools/call_frequency', 0):.2f}", file=sys.stderr, flush=True)

    trainer = GRPOTrainer(model=model, reward_funcs=leg_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, tools=TRL_TOOLS,
                          callbacks=[saving_callback(out, steps, save_every, saved, budget_seconds), Progress()])
    trainer.remove_callback(PrinterCallback)  # it prints every log dict to stdout, where the bench's JSON goes
    trainer.train()
    return saved


def keep_train_episodes(path: Path, rows: list[dict], steps: list[int], completions: list[list[dict]],
                        rewards: list[float]) -> None:
    """Appends one line per TRL training episode: its step, question and reward, TRL's completion messages."""
    lines = "".join(json.dumps({"step": step, "question": row["question"], "reward": r, "messages": c}, default=str)
                    + "\n" for row, step, c, r in zip(rows, steps, completions, rewards, strict=True))
    with path.open("a") as f:  # a batch's lines whole, or none of them
        f.write(lines)


# ---- held-out measure ---------------------------------------------------------------------------

def greedy_episodes(model_dir: Path, adapter: Path | None, rows: list[dict], max_turns: int,
                    max_tokens: int) -> list[tuple[list[dict], Score]]:
    """The held-out measure's episodes, per row: its greedy messages and LegLookupEnv's Score, under
    the example's turn limits (a caller's own defaults once judged at another limit than training's)."""
    return trl_agents.greedy_episodes(model_dir, adapter, [leg_lookup.LegLookupEnv(r) for r in rows],
                                      leg_lookup.CHAT_TEMPLATE.read_text(), max_turns, max_tokens)
