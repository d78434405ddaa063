"""Turns a step's figures into plain-language warnings when training cannot be working
(invariant 8). Each rule names the number, what it means, and what to do."""

from __future__ import annotations

from protocol.metrics import COLLAPSE_WARNING_OPENING, StepMetrics

LOGPROB_GAP_LIMIT = 0.05
TRUNCATED_LIMIT = 0.5
FAILED_LIMIT = 0.5
CLIP_LIMIT = 0.3


NON_FINITE_UPDATE = ("The update made the adapter's weights non-finite (inf or NaN), so this step was rolled back "
                     "and the run keeps serving its last good adapter. Lower the learning rate or LoRA alpha.")


SINGLE_TRAJECTORY = ("a group of one trajectory cannot train: group-relative advantages need at least two "
                     "rollouts per task; raise the group size, or give each group its value (TrainConfig "
                     "baseline 'given', as A*-PO does)")


def step_warnings(m: StepMetrics, previous: StepMetrics | None = None) -> list[str]:
    """`previous`: the figures of the run's last trained RL step, for the rules that compare steps."""
    w: list[str] = []
    total, constant = m.groups_total, m.groups_dropped_constant
    single, failed, stale = m.groups_dropped_single, m.groups_dropped_failed, m.groups_dropped_stale
    no_group_trains = bool(total) and single + failed + constant + stale == total
    if stale:
        w.append(f"{stale} of {total} groups were sampled more than {m.staleness_bound} steps before the weights "
                 f"this step trained (max_steps_off_policy) and were dropped"
                 + (": nothing was trained." if stale == total else ".")
                 + " Their rollouts took longer than the steps that overtook them: raise the bound, shorten the "
                   "slowest rollouts, or sample fewer groups ahead.")
    if single:
        which = f"All {total} groups" if single == total else f"{single} of {total} groups"
        w.append(f"{which} had one trajectory, and {SINGLE_TRAJECTORY}."
                 + (" Nothing was trained." if single == total else ""))
    if total and constant == total:
        w.append(_all_constant(m))
        if previous is not None and _collapsed(m, previous):
            w.append(f"{COLLAPSE_WARNING_OPENING}{previous.reward_mean:.3g} at the last trained step to "
                     f"{m.reward_mean:.3g}, and now every rollout in every group scores the same, which the "
                     f"last step's figures make unlikely by chance: the last update may have broken the "
                     f"policy (a collapse, often into one malformed output). The next attempt samples the same "
                     f"weights: if it fails alike too, read a few completions; the earlier steps are still served "
                     f"(run@N), and a new run with a lower learning rate, more groups per step, or fewer "
                     f"minibatches and epochs may keep what they learned.")
    elif constant and no_group_trains:
        w.append(f"The other {constant} groups had the same reward for every rollout{_split(m)}, so they carry no "
                 f"signal either; nothing was trained.")
    elif m.groups_constant_failed / max(total, 1) >= 0.5:
        w.append(f"{m.groups_constant_failed} of {total} groups failed in every rollout (each scored the lowest "
                 f"reward) and were dropped: most of this batch carries no learning signal. The tasks may be too "
                 f"hard for the model as it is: use easier ones, or larger groups.")
    elif constant / max(total, 1) >= 0.5 and m.groups_constant_solved / max(total, 1) < 0.5:
        # A batch mostly solved is good news, not a fault: the client says so (client/loop/training_loop.py).
        w.append(f"{constant} of {total} groups had constant reward and were dropped{_split(m)}: most of this "
                 f"batch carries no learning signal.")
    if m.trainable_tokens == 0 and not no_group_trains:
        if m.choices == 0:
            w.append("No trainable tokens: the trajectories contain no Choice objects. Append the Choice the "
                     "server returned to messages_and_choices (plain assistant dicts are context only).")
        elif m.prompt_mismatches:
            w.append(f"No trainable tokens: all {m.prompt_mismatches} choices had prompts that could not be "
                     f"rebuilt exactly as the sampler saw them, so none were trained.")
        else:
            w.append("No trainable tokens in this batch; nothing was trained.")
    elif m.prompt_mismatches_trained:
        w.append(f"{m.prompt_mismatches} of {m.choices} choices were sampled from a prompt that could not be "
                 f"rebuilt token for token (edited or truncated history?); {m.prompt_mismatches_trained} were "
                 f"trained anyway after the rebuilt prompt (skip_mismatched_prompts=False), with logprobs the "
                 f"sampler computed after another one: their logprob gap is not an error.")
    elif m.prompt_mismatches:
        w.append(f"{m.prompt_mismatches} of {m.choices} choices were sampled from a prompt that "
                 f"could not be rebuilt token for token (edited or truncated history?); they were not trained "
                 f"(skip_mismatched_prompts=False trains them after the rebuilt prompt).")
    if m.context_only_assistant_messages and m.trainable_tokens == 0:
        w.append(f"{m.context_only_assistant_messages} assistant turns were plain dicts: they are context, "
                 f"not training data.")
    if m.unsampled_choices:
        w.append(f"{m.unsampled_choices} of {m.choices} choices were not sampled by this server (no token ids, and "
                 f"no turn it remembers with that content): they were context, not training data.")
    if m.baseline == "given" and m.advantage_positive_fraction == 0.0 and (m.advantage_mean or 0.0) < 0:
        w.append(f"No trained sample scored above its given value (mean V* {m.value_mean:.3g}, mean advantage "
                 f"{m.advantage_mean:.3g}): every update pushes away from what was sampled and towards nothing. "
                 f"If the values came from reference samples that never succeeded, the tasks are too hard for "
                 f"the base model: start a curriculum lower, or drop prompts no reference sample solved.")
    gap = m.logprob_gap
    # Off-policy groups differ from the trainer by design (the policy moved since they were sampled):
    # the gap says something is wrong only for groups sampled by the weights being trained.
    if gap is not None and gap > LOGPROB_GAP_LIMIT and not m.staleness_max:
        w.append(f"Sampler and trainer disagree on token logprobs (mean gap {gap:.3f}, expected ~0 on-policy): "
                 f"the samples are stale (sampled from an older step) or were not produced by this model.")
    if m.trained and m.lora_update_norm == 0.0 and m.baseline == "given" and m.loss == 0.0:
        w.append("Every trained sample scored exactly its given value and the policy is still the reference: "
                 "A*-PO's residuals were all 0, so the step had no gradient and the LoRA did not move.")
    elif m.trained and m.lora_update_norm == 0.0:
        w.append("The LoRA's weights did not change in this step: the optimizer ran but the model is the same. "
                 "This is a bug (zero learning rate, frozen adapter or zero gradient).")
    if m.truncated_fraction > TRUNCATED_LIMIT:
        w.append(f"{m.truncated_fraction:.0%} of completions hit max_tokens and were cut off: raise max_tokens "
                 f"or the model is looping.")
    rollouts = m.trajectories_total + m.trajectories_excluded
    if rollouts and not m.trajectories_total:
        w.append(f"All {rollouts} rollouts failed with errors and were excluded: nothing was left to train on. "
                 f"Check the server, tools or judge.")
    elif rollouts and m.trajectories_excluded / rollouts > FAILED_LIMIT:
        w.append(f"{m.trajectories_excluded} of {rollouts} rollouts failed with errors and were excluded: "
                 f"the step trained on the few that survived. Check the server, tools or judge.")
    if (m.clip_fraction or 0) > CLIP_LIMIT:
        w.append(f"{m.clip_fraction:.0%} of tokens were clipped: the policy moved far from the sampler's; "
                 f"the learning rate may be too high.")
    if m.skipped_optimizer_steps:
        w.append(f"{m.skipped_optimizer_steps} optimizer steps were skipped because the gradient was not finite.")
    return w


def constant_split(constant: list[float], rewards: list[float]) -> tuple[int, int]:
    """(solved, failed): how many of the constant groups' rewards (`constant`) are the top reward or
    the bottom one. The trainer does not know the task's reward range: the top is the batch's best
    reward, or 1.0 (the usual full marks) when none is higher; the bottom its worst, or 0.0."""
    top, bottom = max([1.0, *rewards]), min([0.0, *rewards])
    return sum(r >= top - 1e-9 for r in constant), sum(r <= bottom + 1e-9 for r in constant)


def _split(m: StepMetrics) -> str:
    """" (3 solved, 2 failed, 1 neither)": the constant groups by their reward, where any are known."""
    solved, failed = m.groups_constant_solved, m.groups_constant_failed
    if not solved and not failed:
        return ""
    neither = m.groups_dropped_constant - solved - failed
    parts = [f"{solved} solved" * bool(solved), f"{failed} failed" * bool(failed), f"{neither} neither" * bool(neither)]
    return f" ({', '.join(p for p in parts if p)})"


def _all_constant(m: StepMetrics) -> str:
    total = m.groups_total
    if m.groups_constant_solved == total:
        return (f"All {total} groups had the same reward for every rollout, the top one: every rollout solved its "
                f"task, so there is nothing left to learn at this difficulty and nothing was trained. Raise the "
                f"difficulty (harder tasks, a curriculum) or stop.")
    if m.groups_constant_failed == total:
        return (f"All {total} groups had the same reward for every rollout, the lowest one: every rollout failed "
                f"its task, so no rollout was better than its siblings and there is no signal to learn from; "
                f"nothing was trained. Use easier tasks, larger groups, or a stronger model.")
    return (f"All {total} groups had the same reward for every rollout{_split(m)}, so no rollout was better than "
            f"its siblings and there is no signal to learn from; nothing was trained. Use larger groups, or tasks "
            f"that the model sometimes solves and sometimes fails.")


# Below this chance of drawing the step's batch from the previous step's policy, it is not luck.
COLLAPSE_CHANCE = 0.05


def _collapsed(m: StepMetrics, previous: StepMetrics) -> bool:
    """A step with signal, then a lower reward that no rollout escapes: what a broken policy looks like.
    (A run that solved its tasks also ends with constant groups, but at a higher reward.) One such batch
    is not proof: tasks differ in difficulty, so four hard ones can fail everywhere from a policy that
    solves others (chain_sum at seed 0 did, and its next attempt at the same weights scored 0.32); the
    warning therefore says what the next attempt will tell.

    Where the previous step had signal in few of its groups (1 of 4 at a reward of 0.09, a hard task),
    a batch where none has any is a likely draw from the same policy, not a sign that the update broke
    it: the chance is taken as the previous step's share of groups without spread, to the power of
    this step's groups."""
    now, before = m.reward_mean, previous.reward_mean
    if not previous.groups_trainable or now is None or before is None or now >= before:
        return False
    with_spread = min(previous.groups_trainable / previous.groups_total, 1.0) if previous.groups_total else 1.0
    return (1 - with_spread) ** m.groups_total < COLLAPSE_CHANCE
