"""TRL's side of the distillation comparison (bench/distill.py): TRL 1.16's DistillationTrainer with
its own tool loop on the demo task. The teacher is the art-server run artisan's student learns from
(exported as PEFT, merged into the base); the student a fresh LoRA of the teacher's settings, given
artisan's student's episodes per step, learning rate, temperature and turn limits.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.demo import task as demo  # noqa: E402
from learn import ADAM_BETAS, ADAM_EPS, MAX_GRAD_NORM  # noqa: E402
from rollouts.env import Task, ToolError  # noqa: E402
from trl_agents import saving_callback, threads, tokenizer_for, trl_tool, trl_tokenizer  # noqa: E402

# Every term in which TRL's distillation differs from artisan's (--teacher, bench/distill.py), beyond
# bench/tool_agent_trl.py's DIFFERENCES for the tool loop itself.
DIFFERENCES = {
    "divergence": "artisan: the sampled token's reverse KL, coef * (log p_teacher - log p_student) as its "
                  "advantage in the PPO-clipped policy gradient; TRL: beta=1, the reverse KL over the whole "
                  "vocabulary at every position (no sampling estimate, no clipping)",
    "temperature": "both at the demo's sampling temperature, which also tempers both distributions in the loss",
    "tool_state": "TRL's tools are plain functions that do not know their episode: get_price answers from the "
                  "current step's table, so each step's tasks name distinct items (artisan's draw from all 48 with "
                  "repeats); a lookup of another task's item in the same step gets that item's price where "
                  "artisan's environment says unknown item",
    "tool_schema": "TRL renders the example's own TOOLS (a template variable in place of the schema it builds "
                   "from the function), so both students see art-server's system turn",
    "tasks": "the same distribution (examples/demo make_task), not the same draws",
}


def item_distinct_steps(steps: int, per_step: int, seed: int) -> list[list[Task]]:
    """`steps` lists of `per_step` demo training tasks, the items within a list distinct."""
    if per_step > len(demo.ITEMS):
        raise ValueError(f"{per_step} tasks a step, but the demo has {len(demo.ITEMS)} items")
    rng = random.Random(seed)
    return [[demo.make_task(rng, item, s * per_step + i, "train")
             for i, item in enumerate(rng.sample(demo.ITEMS, per_step))] for s in range(steps)]


def _template(model_dir: Path) -> str:
    """The model's template, reading the tools it lists from `schema` (chat_template_kwargs) instead
    of TRL's `tools`, which TRL builds from the function and words otherwise."""
    own = tokenizer_for(model_dir).chat_template
    loop = "{%- for tool in tools %}"
    if own.count(loop) != 1:
        raise ValueError("the model's chat template does not list its tools as the embedded one does")
    return own.replace(loop, "{%- for tool in schema %}")


def run_trl_distill(model_dir: Path, teacher_adapter: Path, steps_tasks: list[list[Task]], *, learning_rate: float,
                    temperature: float, max_turns: int, max_tokens_per_turn: int, seed: int, out: Path,
                    save_every: int) -> list[dict[str, Any]]:
    """On-policy distillation with TRL's tool loop: a fresh LoRA (the teacher adapter's settings)
    learns from the merged teacher on each step's tasks, one episode each. Saved every `save_every`
    steps as saving_callback does; one {"step", "train_seconds", "adapter"} per save."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, PrinterCallback
    from trl import DistillationConfig, DistillationTrainer

    threads()
    out = Path(out)
    tokenizer = trl_tokenizer(model_dir, _template(model_dir))
    teacher = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                        str(teacher_adapter)).merge_and_unload()
    lora = json.loads((Path(teacher_adapter) / "adapter_config.json").read_text())
    student = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                             LoraConfig(r=lora["r"], lora_alpha=lora["lora_alpha"], target_modules=lora["target_modules"],
                                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))

    prices: dict[str, int] = {}

    def get_price(item: str) -> dict[str, Any]:
        if item not in prices:
            raise ToolError(f"unknown item {item!r}")
        return {"item": item, "price": prices[item]}

    def before_step(k: int) -> None:
        prices.clear()
        prices.update({t.data["item"]: t.data["price"] for t in steps_tasks[k]})

    dataset = Dataset.from_list([{"prompt": demo.ShopEnv(t).initial_messages()} for tasks in steps_tasks for t in tasks])
    per_step = len(steps_tasks[0])
    config = DistillationConfig(
        output_dir=str(out / "trl"), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=per_step, gradient_accumulation_steps=1, max_steps=len(steps_tasks),
        max_completion_length=2 * max_turns * max_tokens_per_turn,  # the whole episode's, tool results included
        generation_kwargs={"max_new_tokens": max_tokens_per_turn}, max_tool_calling_iterations=max_turns - 1,
        learning_rate=learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=ADAM_BETAS[0], adam_beta2=ADAM_BETAS[1], adam_epsilon=ADAM_EPS, max_grad_norm=MAX_GRAD_NORM,
        temperature=temperature, top_p=1.0, top_k=0, beta=1.0, disable_dropout=True,
        chat_template_kwargs={"schema": demo.TOOLS}, shuffle_dataset=False, seed=seed,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    saved: list[dict[str, Any]] = []
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=config, train_dataset=dataset,
                                  processing_class=tokenizer, tools=[trl_tool(demo.TOOLS[0], get_price)],
                                  callbacks=[saving_callback(out, len(steps_tasks), save_every, saved,
                                                             before_step=before_step)])
    trainer.remove_callback(PrinterCallback)  # it prints every log dict to stdout, where the bench's JSON goes
    trainer.train()
    return saved
