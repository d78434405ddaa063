"""What the benches that set TRL against artisan on a tool-using agent share (bench/tool_agent_trl.py,
bench/distill_trl.py), for any Example's environment:

- `export_peft`: an art-server run's saved adapter as a PEFT adapter directory, so TRL starts from,
  or is taught by, the very weights artisan trained.
- `trl_tool`: an example's tool as the plain function TRL calls, with the docstring its schema is
  built from.
- `greedy_episodes`: in-process greedy episodes, rendered, stopped, decoded and parsed by
  art-server's own chat format (server/chat), so an adapter of either trainer is read exactly as
  art-server would read it, and scored by the example's environment.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
from pathlib import Path
from typing import Any, Callable

from rollouts.agent import tool_content
from rollouts.env import Environment, Score, ToolError, error_text


def trl_tool(spec: dict[str, Any], fn: Callable[..., Any]) -> Callable[..., str]:
    """`fn` as TRL calls a tool: its result as artisan's agent shows it, a ToolError as its error text,
    named and described after `spec` (TRL builds the schema from the docstring)."""
    function = spec["function"]

    def tool(**arguments: Any) -> str:
        try:
            return tool_content(fn(**arguments))
        except ToolError as e:
            return error_text(e)

    params = function["parameters"]["properties"]
    # transformers reads the parameters from the signature: give the wrapper the spec's.
    tool.__signature__ = inspect.Signature([inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=str)
                                            for name in params], return_annotation=str)
    tool.__annotations__ = {**{name: str for name in params}, "return": str}
    tool.__name__ = tool.__qualname__ = function["name"]
    args = "\n".join(f"    {name}: the {name}." for name in params)
    tool.__doc__ = f"{function['description']}\n\nArgs:\n{args}\n"
    return tool


def threads() -> None:
    import torch

    # All the cores, as bench/learn.py does, unless the caller pinned a number.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))


def tokenizer_for(model_dir: Path, chat_template: str | None = None):
    """The model's tokenizer, with `chat_template` in place of its own when given."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def trl_tokenizer(model_dir: Path, chat_template: str | None = None):
    """tokenizer_for's, made ready for TRL's tool loop. TRL recognises chat templates by exact
    text; ours write Qwen's Hermes tags, which its qwen3 response template parses."""
    from trl.chat_template_utils import is_chat_template_prefix_preserving, qwen3_template

    tokenizer = tokenizer_for(model_dir, chat_template)
    tokenizer.response_template = qwen3_template
    if not is_chat_template_prefix_preserving(tokenizer):  # else TRL swaps in a template of its own
        raise ValueError("the example's chat template is not prefix-preserving as TRL checks it")
    return tokenizer


def saving_callback(out: Path, steps: int, save_every: int, saved: list[dict], budget_seconds: float | None = None,
                    before_step: Callable[[int], None] | None = None):
    """A TrainerCallback that saves the adapter to out/step-N every `save_every` steps and at the
    last (`steps`, or the first step whose training seconds pass `budget_seconds`), appending
    {"step", "train_seconds", "adapter"} to `saved`: seconds from the start of training, the saving
    left out. `before_step(k)` is called as optimizer step k (from 0) begins."""
    import time

    from transformers import TrainerCallback

    clock = {"t0": 0.0, "saving": 0.0}

    class SaveEvery(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock["t0"] = time.perf_counter()

        def on_step_begin(self, args, state, control, **kw):
            if before_step is not None:
                before_step(state.global_step)

        def on_step_end(self, args, state, control, model=None, **kw):
            step = state.global_step
            seconds = time.perf_counter() - clock["t0"] - clock["saving"]
            over = budget_seconds is not None and seconds > budget_seconds
            if over:
                control.should_training_stop = True
            if step % save_every == 0 or step == steps or over:
                t = time.perf_counter()
                path = Path(out) / f"step-{step}"
                model.save_pretrained(str(path))
                clock["saving"] += time.perf_counter() - t
                saved.append({"step": step, "train_seconds": round(seconds, 2), "adapter": path})

    return SaveEvery()


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


def _tool_result(env: Environment, call: dict[str, Any]) -> str:
    try:
        function = call["function"]
        return tool_content(asyncio.run(env.call_tool(function["name"], json.loads(function["arguments"]))))
    except ToolError as e:
        return error_text(e)


def greedy_episodes(model_dir: Path, adapter: Path | None, envs: list[Environment], chat_template: str | None = None,
                    max_turns: int = 5, max_tokens: int = 128, batch: int = 16) -> list[tuple[list[dict], Score]]:
    """Greedy episodes of `envs`, run as rollouts/agent.py runs them against art-server: the prompt
    rendered by art-server's renderer (earlier turns as their sampled ids), a turn stopped at
    art-server's stop ids, decoded and parsed by its chat format; the tools run on the environment,
    a ToolError shown as artisan shows it; the episode ends at a reply without calls, a turn cut at
    max_tokens, or after max_turns turns. Per environment: (its messages, its Score)."""
    import torch
    from transformers import AutoModelForCausalLM

    from server.chat.format import ChatFormat, assistant_message
    from server.chat.tool_calls import tool_schemas
    from server.model.host import stop_ids_of

    threads()
    tokenizer = tokenizer_for(model_dir, chat_template)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()  # the same function, faster
    model.eval()
    chat = ChatFormat.build(tokenizer, tokenizer.chat_template, eos_ids=stop_ids_of(Path(model_dir), model.config))
    stop_ids = sorted(chat.stop_ids)
    convs = [env.initial_messages() for env in envs]
    sampled: list[dict[int, list[int]]] = [{} for _ in envs]
    live = list(range(len(envs)))
    for _ in range(max_turns):
        if not live:
            break
        prompts = {i: chat.renderer.render(convs[i], envs[i].tools, True, sampled_ids=sampled[i]).ids for i in live}
        order = sorted(live, key=lambda i: len(prompts[i]))  # like lengths together: less padding
        going = []
        for k in range(0, len(order), batch):
            chunk = order[k:k + batch]
            for i, ids in zip(chunk, _generate(model, [prompts[i] for i in chunk], stop_ids,
                                               tokenizer.pad_token_id, max_tokens)):
                parsed = chat.parse(chat.text(ids), tool_schemas(envs[i].tools))
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


def greedy_rewards(model_dir: Path, adapter: Path | None, envs: list[Environment], chat_template: str | None = None,
                   max_turns: int = 5, max_tokens: int = 128) -> list[float]:
    """The reward of each of `envs`' greedy_episodes, in order."""
    episodes = greedy_episodes(model_dir, adapter, envs, chat_template, max_turns, max_tokens)
    return [score.reward for _, score in episodes]


def greedy_reward(model_dir: Path, adapter: Path | None, envs: list[Environment], chat_template: str | None = None,
                  max_turns: int = 5, max_tokens: int = 128) -> float:
    """The held-out measure: the mean reward of greedy_episodes on `envs`."""
    rewards = greedy_rewards(model_dir, adapter, envs, chat_template, max_turns, max_tokens)
    return sum(rewards) / len(rewards)
