"""Learning speed: GRPO on a reasoning-gym task through art-server vs TRL's GRPOTrainer.

Both train SmolLM2-135M-Instruct (float32, CPU) with a rank-8 LoRA on the same questions in the
same chat messages (examples/reasoning_gym: leg_counting, two solved examples as earlier turns),
scored by reasoning-gym's own score_answer, with the same group size, prompts per step,
learning rate, sampling temperature and max tokens, one optimizer step per batch and no KL.
The trainers run one after the other in this process's run, never at the same time.

- artisan: art-server on the GGUF (a subprocess); rollouts are an artisan `Example` over the
  reasoning-gym rows, sampled through the server's OpenAI API by `rollouts.agent.rollout`, and
  trained by `TrainableModel.train` with the default TrainConfig (PPO-clipped, token-mean).
- TRL 1.16: `GRPOTrainer` in this process (transformers generate, no vLLM), its config set to
  artisan's terms wherever TRL has the knob; what still differs is listed in `differences`.

Held-out accuracy is the mean score on a fixed set of other questions (another seed), answered
greedily (temperature 0), so that a point is not sampling noise and step 0 of both trainers is
the same model answering the same prompts. It is measured before training and every K steps;
a curve point is [training seconds, step, accuracy], where training seconds exclude the
evaluations and the setup (server start, model load), which are reported apart.

    python bench/learn.py                 # the full comparison; one JSON line last, a PNG beside it
    python bench/learn.py --quick         # 2 steps of a few prompts: that it runs end to end
    python bench/learn.py --sweep ...     # tasks x seeds x both trainers (bench/learn_sweep.py)

`a.seed` (the sweep's; 0 otherwise) seeds both LoRA inits and both trainers' sampling (artisan's
per rollout, rollouts/seeding.py); `a.chat_template`
(a Jinja file, for a model whose own template is not the one to serve) goes to both trainers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.local_server import ROOT, LocalServer  # noqa: E402
from examples import reasoning_gym as learn_task  # noqa: E402
from protocol import TrainConfig  # noqa: E402
from greedy_scores import beyond_shuffled, first_and_last, held_out  # noqa: E402

LORA_RANK, LORA_ALPHA = 8, 16.0  # artisan's LoraSettings defaults
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # every linear of a block
ADAM_BETAS, ADAM_EPS, MAX_GRAD_NORM = (0.9, 0.99), 1e-8, 1.0  # server/runs/run.py, TrainConfig
EPS_LOW, EPS_HIGH = 0.2, 0.28  # TrainConfig's PPO clip
# At 4 prompts x 8 per step, the best of 1.3e-3 (art-server's default before it stopped extrapolating
# the Llama fit), 4.9e-4 (its default now) and 2e-4 over 16 steps: the higher two collapse the
# policy's entropy within 8-12 steps (figures in docs/learning.md).
LEARNING_RATE = 2e-4

# Every term in which the two GRPO steps still differ after the settings above.
DIFFERENCES = {
    "advantage": "both reward - group mean, no std scaling (TRL scale_rewards='none'); artisan drops groups whose "
                 "reward spread < 1e-6 but keeps their tokens in the loss normaliser, the same gradient as TRL's "
                 "zero-advantage rows",
    "loss_aggregation": "both token-mean over the whole step's completion tokens (artisan token_mean, TRL 'dapo')",
    "ratio_and_clipping": "both PPO-clipped at [0.8, 1.28] per token; artisan's old logprobs are the sampler's "
                          "(engine) logprobs, TRL's are the trainer's own forward detached (ratio exactly 1), so "
                          "artisan's step also carries the sampler-trainer gap (~1e-5 here)",
    "optimizer": "both AdamW lr constant, betas (0.9, 0.99), eps 1e-8, weight decay 0, grad clip 1.0; TRL's "
                 "Trainer schedules lr with a constant scheduler and no warm-up, artisan has no scheduler",
    "adam_state": "artisan keeps one AdamW per run across steps (as TRL does); both bias-correct",
    "lora": "both peft LoraConfig r=8 alpha=16 dropout 0 on q,k,v,o,gate,up,down, B=0 init, A drawn after "
            "torch.manual_seed(0); the draws match only if both add the modules in the same order",
    "sampling": "both temperature T, top_p 1, no top_k (TRL top_k=0 overrides transformers' default 50), no "
                "repetition penalty; artisan samples in its own batched engine, TRL with model.generate",
    "stop": "artisan stops at every EOS of the generation config and the template's end of turn; TRL at the "
            "tokenizer's EOS (SmolLM2: both <|im_end|>)",
    "truncation": "neither masks completions cut at max_tokens",
    "prompt_order": "both take the training rows in order, prompts_per_step per step (TRL shuffle_dataset=False)",
    "step_with_no_signal": "a step whose every group has one reward: artisan does not step (nothing to train); "
                           "TRL steps AdamW on a zero gradient, which still moves the LoRA by its momentum",
    "dynamic_sampling": "off by default; --dynamic-sampling N makes artisan set aside up to N groups a step whose "
                        "rollouts all scored alike and sample the next questions in their place (TRL 1.16 has no "
                        "such option), so artisan then samples more and trains on other questions than TRL",
    "precision": "both float32 on CPU (TRL bf16=False, gradient checkpointing off)",
    "per_step_work": "artisan also runs its health figures (a no-adapter forward of one micro-batch for KL to "
                     "base, entropy, LoRA update norm), writes a checkpoint and serves the new adapter, and the "
                     "rollouts go over HTTP; TRL computes entropy and logs. Both spend most of a step in the "
                     "prompt's forward passes: the two-shot prompt is 150-250 tokens, the answers 2-3",
}


# ---- artisan ------------------------------------------------------------------------------------

def train_size(a: argparse.Namespace) -> int:
    """Training questions a run may draw: a step's, and with dynamic sampling those that replace the
    groups set aside. The first steps x prompts are the same questions for both trainers."""
    return a.steps * (a.prompts_per_step + a.dynamic_sampling)


async def _artisan_eval(client, model: str, eval_rows, prompt: str, max_tokens: int) -> dict[str, Any]:
    return held_out(await learn_task.greedy_replies(client, model, eval_rows, prompt, max_tokens), eval_rows)


async def step_groups(sample, tasks: Iterator[Any], n: int, max_set_aside: int,
                      min_spread: float = TrainConfig.model_fields["min_group_reward_spread"].default
                      ) -> tuple[list[Any], int]:
    """A step's n groups, sampled n at a time. With dynamic sampling (DAPO's, client.train's
    --dynamic-sampling), a group whose rollouts all scored alike trains nothing, so up to
    `max_set_aside` of them are set aside and replaced by groups of the next questions; past that,
    groups go in as they come. Returns the groups and how many were set aside."""
    from client.loop.training_loop import scored_alike

    kept: list[Any] = []
    aside = 0
    while len(kept) < n:
        for group in await sample([next(tasks) for _ in range(n - len(kept))]):
            if aside < max_set_aside and scored_alike(group, min_spread):
                aside += 1
            else:
                kept.append(group)
    return kept, aside


async def _artisan_train(url: str, a: argparse.Namespace, train_rows, eval_rows) -> dict[str, Any]:
    from client import TrainableModel, gather_trajectory_groups
    from rollouts.agent import rollout
    from rollouts.env import Task
    from rollouts.seeding import derive_seed, seeded

    example = learn_task.make_example(a.task, a.prompt, reward=a.reward)
    example.settings.temperature, example.settings.max_tokens = a.temperature, a.max_tokens
    tasks = iter([Task(id=str(i), data={"row": r}) for i, r in enumerate(train_rows)])
    model = await TrainableModel("learn", lora={"rank": LORA_RANK, "alpha": LORA_ALPHA, "target_modules": LORA_TARGETS,
                                                "seed": getattr(a, "seed", 0)}).register(url)
    config = TrainConfig(learning_rate=a.lr, max_grad_norm=MAX_GRAD_NORM, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH)
    curve, steps, evals, trained_steps = [], [], [], 0
    train_seconds = 0.0
    async with model.openai_client(max_retries=0) as client:
        async def sample(batch):
            # Each rollout's sampling seeded from the run's seed, its question and its member: a seed's
            # rerun samples the same, and the sweep's seeds differ in sampling as TRL's do.
            return await gather_trajectory_groups(
                [[seeded(rollout(client, model.name, example.make_env(t), t, example.settings),
                         derive_seed(getattr(a, "seed", 0), t.data["row"]["question"], k)) for k in range(a.group_size)]
                 for t in batch], progress=False, concurrency=len(batch) * a.group_size)  # one batch, as TRL samples

        evals.append(await _artisan_eval(client, model.name, eval_rows, a.prompt, a.max_tokens))
        curve.append([0.0, 0, evals[-1]["accuracy"]])
        print(f"artisan step 0: held-out {curve[-1][2]:.3f}", file=sys.stderr, flush=True)
        for step in range(1, a.steps + 1):
            started = time.perf_counter()
            groups, aside = await step_groups(sample, tasks, a.prompts_per_step, a.dynamic_sampling,
                                              config.min_group_reward_spread)
            sampled = time.perf_counter()
            result = await model.train(groups, config)
            train_seconds += time.perf_counter() - started
            trained_steps += int(result.trained)
            rewards = [t.reward for g in groups for t in g.trajectories]
            steps.append({"step": step, "reward": sum(rewards) / len(rewards), "trained": result.trained,
                          "set_aside": aside, "logprob_gap": result.metrics.logprob_gap,
                          "seconds": round(train_seconds, 2),
                          "split": step_split(sampled - started, time.perf_counter() - sampled, result.metrics)})
            print(f"artisan step {step}: reward {steps[-1]['reward']:.3f} trained {result.trained} "
                  f"set aside {aside} ({train_seconds:.1f}s)", file=sys.stderr, flush=True)
            if step % a.eval_every == 0 or step == a.steps:
                evals.append(await _artisan_eval(client, model.name, eval_rows, a.prompt, a.max_tokens))
                curve.append([round(train_seconds, 2), step, evals[-1]["accuracy"]])
                print(f"artisan step {step}: held-out {curve[-1][2]:.3f}", file=sys.stderr, flush=True)
    return {"curve": curve, "steps": steps, "trained_steps": trained_steps, "held_out": first_and_last(evals),
            "time_split": median_split([s["split"] for s in steps if s["trained"]])}


# A step's wall time on the client, split where it was spent: sampling (and scoring, which here is a
# string comparison inside it), then the train call: the server's queue, the batch's assembly, the
# forward, backward and optimizer passes, the checkpoint and the serving of the new adapter, and
# what is left (HTTP, the health figures, the step's records).
PHASES = ("sample", "queue", "assembly", "forward", "backward", "optimizer", "checkpoint", "publish", "other")


def step_split(sample_seconds: float, train_call_seconds: float, m) -> dict[str, float]:
    server = {"queue": m.queue_seconds, "assembly": m.assembly_seconds, "forward": m.forward_seconds,
              "backward": m.backward_seconds, "optimizer": m.optimizer_seconds,
              "checkpoint": m.checkpoint_seconds, "publish": m.publish_seconds}
    server = {k: v or 0.0 for k, v in server.items()}
    split = {"sample": sample_seconds, **server, "other": max(train_call_seconds - sum(server.values()), 0.0)}
    return {k: round(v, 3) for k, v in split.items()}


def median_split(splits: list[dict[str, float]]) -> dict[str, Any]:
    """Each phase's median seconds over the trained steps, and its share of their sum."""
    if not splits:
        return {}
    medians = {k: round(statistics.median(s[k] for s in splits), 3) for k in PHASES}
    total = sum(medians.values()) or 1.0
    return {"median_seconds": medians, "share": {k: round(v / total, 3) for k, v in medians.items()}}


def run_artisan(a: argparse.Namespace, gguf: Path, cache: Path, train_rows, eval_rows, work: Path) -> dict[str, Any]:
    started = time.perf_counter()
    template = getattr(a, "chat_template", None)
    extra = ["--device", "cpu", "--cache-dir", str(cache)] + (["--chat-template", str(template)] if template else [])
    extra += [arg for text in getattr(a, "stop_tokens", ()) for arg in ("--stop-token", text)]
    with LocalServer(work / "artisan-data", model=gguf, extra=extra) as server:
        setup = time.perf_counter() - started
        out = asyncio.run(_artisan_train(server.url, a, train_rows, eval_rows))
    return {**out, "setup_seconds": round(setup, 2)}


# ---- TRL ----------------------------------------------------------------------------------------

def _greedy_eval(model, tokenizer, eval_rows, prompt: str, max_tokens: int, batch: int = 32) -> dict[str, Any]:
    import torch

    was_training = model.training
    model.eval()
    replies = []
    tokenizer.padding_side = "left"
    for i in range(0, len(eval_rows), batch):
        rows = eval_rows[i:i + batch]
        texts = [tokenizer.apply_chat_template(learn_task.messages(r, prompt), tokenize=False, add_generation_prompt=True)
                 for r in rows]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False, top_k=None, top_p=None,
                                 temperature=None, pad_token_id=tokenizer.pad_token_id)
        for r, ids in zip(rows, out[:, enc["input_ids"].shape[1]:]):
            replies.append(tokenizer.decode(ids, skip_special_tokens=True))
    model.train(was_training)
    return held_out(replies, eval_rows)


def _add_stop_tokens(generation_config, tokenizer, texts) -> None:
    """art-server's --stop-token for TRL: GRPOTrainer stops and masks at the generation config's EOS ids."""
    from server.chat.format import stop_token_id

    eos = generation_config.eos_token_id
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    generation_config.eos_token_id = sorted({*ids, *(stop_token_id(tokenizer, t) for t in texts)})


def run_trl(a: argparse.Namespace, model_dir: Path, train_rows, eval_rows, work: Path) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    started = time.perf_counter()
    torch.set_num_threads(os.cpu_count() or 1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(a, "chat_template", None):  # the template art-server is given, so both render the same prompt
        tokenizer.chat_template = Path(a.chat_template).read_text()
    seed = getattr(a, "seed", 0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    _add_stop_tokens(base.generation_config, tokenizer, getattr(a, "stop_tokens", ()))
    torch.manual_seed(seed)  # artisan seeds its LoRA's init with LoraSettings.seed
    model = get_peft_model(base, LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=LORA_TARGETS,
                                            lora_dropout=0.0, bias="none"))
    used = a.steps * a.prompts_per_step
    dataset = Dataset.from_list([{"prompt": learn_task.messages(r, a.prompt), "row": i}
                                 for i, r in enumerate(train_rows[:used])])

    scorer = learn_task.REWARDS[a.reward]

    def reward(prompts, completions, row, **_):
        return [scorer(c[-1]["content"], train_rows[i]) for c, i in zip(completions, row)]

    config = GRPOConfig(
        output_dir=str(work / "trl"), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=a.prompts_per_step * a.group_size, gradient_accumulation_steps=1,
        num_generations=a.group_size, max_completion_length=a.max_tokens, max_steps=a.steps, num_iterations=1,
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=ADAM_BETAS[0], adam_beta2=ADAM_BETAS[1], adam_epsilon=ADAM_EPS, max_grad_norm=MAX_GRAD_NORM,
        temperature=a.temperature, top_p=1.0, top_k=0, repetition_penalty=1.0,
        beta=0.0, epsilon=EPS_LOW, epsilon_high=EPS_HIGH, loss_type="dapo", scale_rewards="none",
        mask_truncated_completions=False, shuffle_dataset=False, seed=seed,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)

    curve: list[list[float]] = []
    evals: list[dict[str, Any]] = []
    clock = {"eval": 0.0, "t0": 0.0}
    step_seconds: dict[int, float] = {}

    class Evaluate(TrainerCallback):
        def _eval(self, step: int, model) -> None:
            t = time.perf_counter()
            seconds = t - clock["t0"] - clock["eval"]
            evals.append(_greedy_eval(model, tokenizer, eval_rows, a.prompt, a.max_tokens))
            curve.append([round(max(seconds, 0.0), 2) if step else 0.0, step, evals[-1]["accuracy"]])
            clock["eval"] += time.perf_counter() - t
            print(f"trl step {step}: held-out {curve[-1][2]:.3f} ({seconds:.1f}s)", file=sys.stderr, flush=True)

        def on_train_begin(self, args, state, control, model=None, **kw):
            clock["t0"] = time.perf_counter()
            self._eval(0, model)

        def on_step_end(self, args, state, control, model=None, **kw):
            step_seconds[state.global_step] = round(time.perf_counter() - clock["t0"] - clock["eval"], 2)
            if state.global_step % a.eval_every == 0 or state.global_step == a.steps:
                self._eval(state.global_step, model)

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Evaluate()])
    trainer.remove_callback(PrinterCallback)  # it prints every log dict to stdout, where the JSON line goes
    setup = time.perf_counter() - started
    trainer.train()
    steps = [{"step": h["step"], "reward": h.get("reward"), "seconds": step_seconds.get(h["step"])}
             for h in trainer.state.log_history if "reward" in h]
    return {"curve": curve, "steps": steps, "held_out": first_and_last(evals), "setup_seconds": round(setup, 2)}


# ---- report -------------------------------------------------------------------------------------

def compare(artisan: list[list[float]], trl: list[list[float]]) -> dict[str, Any]:
    """time_ratio_to_trl_final: artisan's training seconds to first reach the held-out accuracy TRL
    ends with, over TRL's own seconds to first reach it (None if artisan never does, or if TRL
    ended no better than it started: there is no learning to time). per_step: the ratio of the
    two runs' total training seconds for the same number of steps."""
    target = trl[-1][2]

    def first(curve):
        return next((t for t, _, acc in curve if acc >= target), None)

    learned = target > trl[0][2]
    t_artisan, t_trl = first(artisan), first(trl)
    ratio = round(t_artisan / t_trl, 3) if learned and t_artisan is not None and t_trl else None
    return {"trl_final_accuracy": target, "trl_learned": learned, "time_ratio_to_trl_final": ratio,
            "time_ratio_per_step": round(artisan[-1][0] / max(trl[-1][0], 1e-9), 3)}


def plot(result: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in ("artisan", "trl"):
        if name in result:
            xs, steps, ys = zip(*result[name]["curve"])
            ax.plot(xs, ys, marker="o", label=f"{name} (steps {steps[0]}..{steps[-1]})")
    ax.set_xlabel("training wall time (s, evaluations excluded)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_run_options(ap: argparse.ArgumentParser, max_tokens_help: str | None = None) -> None:
    """The settings one run of both trainers shares (the single comparison's and the sweep's)."""
    ap.add_argument("--prompt", default=learn_task.PROMPT, choices=sorted(learn_task.PROMPTS))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--eval-n", type=int, default=64, help="held-out questions")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--lr", type=float, default=LEARNING_RATE,
                    help="both trainers' (art-server's own default for SmolLM2 is 4.9e-4; see docs/learning.md)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=8, help=max_tokens_help)
    ap.add_argument("--reward", default=learn_task.REWARD, choices=sorted(learn_task.REWARDS),
                    help="both trainers' training reward: reasoning-gym's score_answer, or its full credit alone "
                         "(exact); held-out accuracy is score_answer's either way")
    ap.add_argument("--dynamic-sampling", type=int, default=0,
                    help="artisan only (TRL 1.16 has none): set aside up to N groups a step whose rollouts all "
                         "scored alike, and sample the next questions in their place")


def main() -> None:
    if "--sweep" in sys.argv[1:]:
        from learn_sweep import main as sweep  # bench/ is sys.path[0] when this file runs as a script

        return sweep([arg for arg in sys.argv[1:] if arg != "--sweep"])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default=learn_task.TASK, choices=sorted(learn_task.SETTINGS))
    add_run_options(ap)
    ap.add_argument("--only", choices=["artisan", "trl"], help="run one trainer")
    ap.add_argument("--quick", action="store_true", help="2 steps, 4 prompts x 8, 16 held-out questions")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench-learn")
    ap.add_argument("--sweep", action="store_true", help="tasks x seeds x both trainers: see --sweep --help")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.eval_every, a.eval_n, a.group_size, a.prompts_per_step = 2, 1, 16, 8, 4
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    from tests.real_models import CACHE, converted, smollm2_gguf

    gguf = smollm2_gguf()
    model_dir = converted(gguf)  # the same float32 weights art-server dequantises and serves
    train_rows = learn_task.rows(a.task, train_size(a), learn_task.TRAIN_SEED)
    eval_rows = learn_task.rows(a.task, a.eval_n, learn_task.EVAL_SEED)
    a.out.mkdir(parents=True, exist_ok=True)

    settings = {k: getattr(a, k) for k in ("task", "prompt", "steps", "eval_every", "eval_n", "group_size",
                                            "prompts_per_step", "lr", "temperature", "max_tokens",
                                            "reward", "dynamic_sampling")}
    settings.update(model=gguf.name, lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA, eval="greedy", kl=0.0,
                    options=learn_task.SETTINGS[a.task])
    result: dict[str, Any] = {"settings": settings}
    with tempfile.TemporaryDirectory(prefix="bench-learn-") as scratch:
        work = Path(scratch)
        if a.only in (None, "artisan"):
            result["artisan"] = run_artisan(a, gguf, CACHE, train_rows, eval_rows, work)
        if a.only in (None, "trl"):
            result["trl"] = run_trl(a, model_dir, train_rows, eval_rows, work)
    for name in ("artisan", "trl"):
        if name in result:
            held = result[name]["held_out"]
            result[name]["beyond_shuffled"] = {k: beyond_shuffled(held[k]) for k in ("base", "final")}
    if "artisan" in result and "trl" in result:
        result.update(compare(result["artisan"]["curve"], result["trl"]["curve"]))
    result["differences"] = DIFFERENCES
    png = a.out / "learn.png"
    plot(result, png, f"SmolLM2-135M GRPO on {a.task} ({a.steps} steps of {a.prompts_per_step}x{a.group_size}, "
                      f"lr {a.lr:.3g}, T {a.temperature})")
    result["plot"] = str(png)
    (a.out / "learn.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
