"""Turns a step's figures into plain-language warnings when training cannot be working
(invariant 8). Each rule names the number, what it means, and what to do."""

from __future__ import annotations

from typing import Any

LOGPROB_GAP_LIMIT = 0.05
TRUNCATED_LIMIT = 0.5
FAILED_LIMIT = 0.5
CLIP_LIMIT = 0.3


def step_warnings(m: dict[str, Any], previous: dict[str, Any] | None = None) -> list[str]:
    """`previous`: the figures of the run's last trained RL step, for the rules that compare steps."""
    w: list[str] = []
    total, constant = m.get("groups_total", 0), m.get("groups_dropped_constant", 0)
    if total and constant == total:
        w.append(f"All {total} groups had the same reward for every rollout, so no rollout was better than "
                 f"its siblings and there is no signal to learn from; nothing was trained. Use larger groups, "
                 f"or tasks that the model sometimes solves and sometimes fails.")
        if _collapsed(m, previous or {}):
            w.append(f"Reward fell from {previous['reward_mean']:.3g} at the last trained step to "
                     f"{m['reward_mean']:.3g}, and now every rollout in every group scores the same: the last "
                     f"update probably broke the policy (a collapse, often into one malformed output). Nothing "
                     f"can train from here. Read a few completions, then resume from an earlier checkpoint "
                     f"with a lower learning rate, more groups per step, or fewer minibatches and epochs.")
    elif constant and constant / max(total, 1) >= 0.5:
        w.append(f"{constant} of {total} groups had constant reward and were dropped: most of this batch "
                 f"carries no learning signal.")
    if m.get("trainable_tokens", 0) == 0 and not (total and constant == total):
        if m.get("choices", 0) == 0:
            w.append("No trainable tokens: the trajectories contain no Choice objects. Append the Choice the "
                     "server returned to messages_and_choices (plain assistant dicts are context only).")
        elif m.get("prompt_mismatches", 0):
            w.append(f"No trainable tokens: all {m['prompt_mismatches']} choices had prompts that could not be "
                     f"rebuilt exactly as the sampler saw them, so none were trained.")
        else:
            w.append("No trainable tokens in this batch; nothing was trained.")
    elif m.get("prompt_mismatches", 0):
        w.append(f"{m['prompt_mismatches']} of {m.get('choices', 0)} choices were sampled from a prompt that "
                 f"could not be rebuilt token for token (edited or truncated history?); they were not trained.")
    if m.get("context_only_assistant_messages", 0) and m.get("trainable_tokens", 0) == 0:
        w.append(f"{m['context_only_assistant_messages']} assistant turns were plain dicts: they are context, "
                 f"not training data.")
    gap = m.get("logprob_gap")
    if gap is not None and gap > LOGPROB_GAP_LIMIT:
        w.append(f"Sampler and trainer disagree on token logprobs (mean gap {gap:.3f}, expected ~0 on-policy): "
                 f"the samples are stale (sampled from an older step) or were not produced by this model.")
    if m.get("trained") and m.get("lora_update_norm", 1.0) == 0.0:
        w.append("The LoRA's weights did not change in this step: the optimizer ran but the model is the same. "
                 "This is a bug (zero learning rate, frozen adapter or zero gradient).")
    if (m.get("truncated_fraction") or 0) > TRUNCATED_LIMIT:
        w.append(f"{m['truncated_fraction']:.0%} of completions hit max_tokens and were cut off: raise max_tokens "
                 f"or the model is looping.")
    rollouts = m.get("trajectories_total", 0) + m.get("trajectories_excluded", 0)
    if rollouts and m.get("trajectories_excluded", 0) / rollouts > FAILED_LIMIT:
        w.append(f"{m['trajectories_excluded']} of {rollouts} rollouts failed with errors and were excluded: "
                 f"the step trained on the few that survived. Check the server, tools or judge.")
    if (m.get("clip_fraction") or 0) > CLIP_LIMIT:
        w.append(f"{m['clip_fraction']:.0%} of tokens were clipped: the policy moved far from the sampler's; "
                 f"the learning rate may be too high.")
    if m.get("skipped_optimizer_steps"):
        w.append(f"{m['skipped_optimizer_steps']} optimizer steps were skipped because the gradient was not finite.")
    return w


def _collapsed(m: dict[str, Any], previous: dict[str, Any]) -> bool:
    """A step with signal, then a lower reward that no rollout escapes: what a broken policy looks like.
    (A run that solved its tasks also ends with constant groups, but at a higher reward.)"""
    now, before = m.get("reward_mean"), previous.get("reward_mean")
    return bool(previous.get("groups_trainable")) and now is not None and before is not None and now < before
