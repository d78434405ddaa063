"""A reward plugged into the reasoning-gym taskset from config (verifiers' `[env.taskset.task.rewards]`),
so that the mechanics tests see a reward spread even when the 135M model solves nothing."""


async def reply_chars(trace) -> float:
    return float(len(trace.last_reply or ""))
