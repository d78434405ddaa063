"""TRL's side of the tool-agent comparison (bench/tool_agent.py), and the held-out measure both
trainers are judged by.

- `export_peft`: an art-server run's saved adapter (its warm start, say) as a PEFT adapter
  directory, so TRL continues training from the very weights artisan starts its GRPO from.
- `run_trl`: TRL 1.16's GRPOTrainer with its own tool loop on examples/leg_lookup, from that
  adapter, its config set to artisan's step wherever TRL has the knob (bench/learn.py's terms).
- `greedy_success`: in-process greedy episodes on held-out rows, rendered, stopped, decoded and
  parsed by art-server's own chat format (server/chat), so an adapter of either trainer is read
  exactly as art-server would read it; the reward is LegLookupEnv.score's.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples import leg_lookup  # noqa: E402
from learn import (ADAM_BETAS, ADAM_EPS, EPS_HIGH, EPS_LOW, LORA_ALPHA, LORA_RANK,  # noqa: E402
                   LORA_TARGETS, MAX_GRAD_NORM)
from rollouts.agent import tool_content  # noqa: E402
from rollouts.env import ToolError  # noqa: E402

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


def error_text(error: ToolError) -> str:
    """What artisan's agent shows the model for a rejected call (rollouts/agent.py, _run_tool)."""
    return f"Error: {error}"


def _described(spec: dict[str, Any]) -> Callable[[Callable[..., str]], Callable[..., str]]:
    """Set a wrapper's docstring from the example's tool spec, so TRL's schema (built from the
    docstring) renders the same system turn as artisan's TOOLS."""
    def apply(fn: Callable[..., str]) -> Callable[..., str]:
        function = spec["function"]
        args = "\n".join(f"    {name}: the {name}." for name in function["parameters"]["properties"])
        fn.__doc__ = f"{function['description']}\n\nArgs:\n{args}\n"
        return fn
    return apply


_SPECS = {t["function"]["name"]: t for t in leg_lookup.TOOLS}


@_described(_SPECS["legs"])
def legs(animal: str) -> str:
    try:
        return leg_lookup.legs(animal)
    except ToolError as e:
        return error_text(e)


@_described(_SPECS["calculate"])
def calculate(expression: str) -> str:
    try:
        return leg_lookup.calculate(expression)
    except ToolError as e:
        return error_text(e)


TRL_TOOLS = [legs, calculate]


def reward(row: dict[str, Any], completion: list[dict[str, Any]]) -> float:
    """LegLookupEnv.score's reward for one TRL episode: the opening plus TRL's completion messages."""
    env = leg_lookup.LegLookupEnv(row)
    return asyncio.run(env.score([*leg_lookup.opening(row), *completion])).reward


# ---- art-server adapter -> PEFT -----------------------------------------------------------------

def export_peft(checkpoint_root: Path, step: int, run_json: Path, out: Path) -> Path:
    """`out` as a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) holding
    the run's adapter at `step`. art-server saves get_peft_model_state_dict's keys, which are what
    PEFT's save_pretrained writes, so the tensors go over as they are; the LoRA settings are the
    run's (run.json), the target modules its own or, when the run let the server choose, the ones
    the saved tensors name."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    from server.runs import checkpoints
    from server.runs.base_models import RunRecord

    spec = RunRecord.model_validate_json(Path(run_json).read_text())  # RunSpec and the base model's fingerprint
    state = checkpoints.read_adapter(Path(checkpoint_root), step)
    named = sorted({key.split(".lora_")[0].rsplit(".", 1)[-1] for key in state if ".lora_" in key})
    # server/runs/run.py's lora_config: dropout 0, no bias
    config = LoraConfig(r=spec.lora.rank, lora_alpha=spec.lora.alpha, target_modules=spec.lora.target_modules or named,
                        lora_dropout=0.0, bias="none", base_model_name_or_path=spec.base_model)
    config.task_type = "CAUSAL_LM"  # PeftModel.from_pretrained then builds a PeftModelForCausalLM, as TRL expects
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    return out


# ---- TRL ----------------------------------------------------------------------------------------

def _tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.chat_template = leg_lookup.CHAT_TEMPLATE.read_text()  # what art-server is given for this example
    return tokenizer


def _threads() -> None:
    import torch

    # All the cores, as bench/learn.py does, unless the caller pinned a number.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))


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
            seed: int, out: Path, save_every: int, budget_seconds: float | None) -> list[dict]:
    """GRPO with TRL's tool loop from `start_adapter`, on `train_rows` in order, prompts_per_step x
    group_size episodes per optimizer step. The adapter is saved to out/step-N every `save_every`
    steps and at the last step (`steps`, or the first step whose training seconds pass
    `budget_seconds`). One {"step", "train_seconds", "adapter"} per saved step, train_seconds
    counting from the start of training and leaving the saving out."""
    import torch
    from datasets import Dataset
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import is_chat_template_prefix_preserving, qwen3_template

    _check_lora(start_adapter)
    _threads()
    out = Path(out)
    tokenizer = _tokenizer(model_dir)
    # TRL recognises chat templates by exact text; ours writes Qwen's Hermes tags, which its qwen3
    # response template parses.
    tokenizer.response_template = qwen3_template
    if not is_chat_template_prefix_preserving(tokenizer):  # else TRL swaps in a template of its own
        raise ValueError("the example's chat template is not prefix-preserving as TRL checks it")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(start_adapter), is_trainable=True)
    used = train_rows[:steps * prompts_per_step]
    dataset = Dataset.from_list([{"prompt": leg_lookup.opening(r), "row": i} for i, r in enumerate(used)])

    def leg_reward(prompts, completions, row, **_):
        return [reward(used[i], c) for c, i in zip(completions, row)]

    config = GRPOConfig(
        output_dir=str(out / "trl"), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=prompts_per_step * group_size, gradient_accumulation_steps=1,
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
    clock = {"t0": 0.0, "saving": 0.0}

    class SaveAndBudget(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock["t0"] = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            step = state.global_step
            seconds = time.perf_counter() - clock["t0"] - clock["saving"]
            over = budget_seconds is not None and seconds > budget_seconds
            if over:
                control.should_training_stop = True
            if step % save_every == 0 or step == steps or over:
                t = time.perf_counter()
                path = out / f"step-{step}"
                model.save_pretrained(str(path))
                clock["saving"] += time.perf_counter() - t
                saved.append({"step": step, "train_seconds": round(seconds, 2), "adapter": path})

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                print(f"trl step {state.global_step}: reward {logs['reward']:.3f} tool calls/episode "
                      f"{logs.get('tools/call_frequency', 0):.2f}", file=sys.stderr, flush=True)

    trainer = GRPOTrainer(model=model, reward_funcs=leg_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, tools=TRL_TOOLS, callbacks=[SaveAndBudget()])
    trainer.remove_callback(PrinterCallback)  # it prints every log dict to stdout, where the bench's JSON goes
    trainer.train()
    return saved


# ---- held-out measure ---------------------------------------------------------------------------

def _generate(model, prompts: list[list[int]], stop_ids: list[int], pad_id: int, max_tokens: int) -> list[list[int]]:
    """Greedy continuations, each up to and including its first stop token (none when cut at max_tokens)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                             top_k=None, top_p=None, temperature=None, eos_token_id=stop_ids, pad_token_id=pad_id)
    turns = []
    for row in out[:, width:].tolist():
        end = next((k for k, t in enumerate(row) if t in stop_ids), None)
        turns.append(row if end is None else row[:end + 1])
    return turns


def _tool_result(env: leg_lookup.LegLookupEnv, call: dict[str, Any]) -> str:
    try:
        function = call["function"]
        return tool_content(asyncio.run(env.call_tool(function["name"], json.loads(function["arguments"]))))
    except ToolError as e:
        return error_text(e)


def greedy_episodes(model_dir: Path, adapter: Path | None, rows: list[dict], max_turns: int = 5,
                    max_tokens: int = 128, batch: int = 16) -> list[tuple[list[dict], Any]]:
    """Greedy episodes on `rows`, run as rollouts/agent.py runs them against art-server: the prompt
    rendered by art-server's renderer (earlier turns as their sampled ids), a turn stopped at
    art-server's stop ids, decoded and parsed by its chat format; the tools run on the row's
    environment, a ToolError shown as artisan shows it; the episode ends at a reply without calls,
    a turn cut at max_tokens, or after max_turns turns. Per row: (its messages, LegLookupEnv's Score)."""
    import torch
    from transformers import AutoModelForCausalLM

    from server.chat.format import ChatFormat, assistant_message
    from server.model.host import stop_ids_of

    _threads()
    tokenizer = _tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()  # the same function, faster
    model.eval()
    chat = ChatFormat.build(tokenizer, tokenizer.chat_template, eos_ids=stop_ids_of(Path(model_dir), model.config))
    stop_ids = sorted(chat.stop_ids)
    envs = [leg_lookup.LegLookupEnv(r) for r in rows]
    convs = [env.initial_messages() for env in envs]
    sampled: list[dict[int, list[int]]] = [{} for _ in rows]
    live = list(range(len(rows)))
    for _ in range(max_turns):
        if not live:
            break
        prompts = {i: chat.renderer.render(convs[i], leg_lookup.TOOLS, True, sampled_ids=sampled[i]).ids
                   for i in live}
        order = sorted(live, key=lambda i: len(prompts[i]))  # like lengths together: less padding
        going = []
        for k in range(0, len(order), batch):
            chunk = order[k:k + batch]
            for i, ids in zip(chunk, _generate(model, [prompts[i] for i in chunk], stop_ids,
                                               tokenizer.pad_token_id, max_tokens)):
                parsed = chat.parse(chat.text(ids), tools_enabled=True)
                message = assistant_message(parsed)
                sampled[i][len(convs[i])] = ids
                convs[i].append(message)
                if not (ids and ids[-1] in chat.stop_ids) or not parsed.tool_calls:
                    continue  # cut at max_tokens, or an answer (a malformed call included): the episode is over
                convs[i] += [{"role": "tool", "tool_call_id": call["id"], "content": _tool_result(envs[i], call)}
                             for call in message["tool_calls"]]
                going.append(i)
        live = going
    return [(conv, asyncio.run(env.score(conv))) for env, conv in zip(envs, convs)]


def greedy_success(model_dir: Path, adapter: Path | None, rows: list[dict], max_turns: int = 5,
                   max_tokens: int = 128, batch: int = 16) -> float:
    """The held-out measure: the mean LegLookupEnv reward of greedy_episodes on `rows`."""
    episodes = greedy_episodes(model_dir, adapter, rows, max_turns, max_tokens, batch)
    return sum(score.reward for _, score in episodes) / len(episodes)
