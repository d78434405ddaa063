"""RULER-style relative judging: an LLM judge scores the trajectories of one group against each other.

GRPO only uses the order of rewards inside a group, so a judge that compares the group's attempts
side by side is both cheaper and more consistent than one that scores each attempt alone.

Usage::

    group = await score_group(group, "openai/gpt-4o-mini")                   # any litellm model
    group = await score_group(group, "http://127.0.0.1:8000/v1#qwen-judge")  # OpenAI-compatible
    group = await score_group(group, JudgeConfig(model="judge", base_url="http://...", api_key="k"))

Judge spec strings: anything starting with ``http://`` or ``https://`` is ``<base_url>#<model>`` and
goes through the ``openai`` SDK (``api_key`` only via :class:`JudgeConfig`); anything else is a
litellm model string and goes through ``litellm.acompletion`` (credentials from the environment,
as litellm reads them).

Failure policy (DESIGN invariant 4): a judge that is down or never gives a valid answer raises
:class:`JudgeError`; it never turns into zero rewards. Whoever gathers groups (see
:func:`ruler_hook`) is responsible for turning that raised error into the group's exception
entries, with all of the group's trajectories excluded from training.

Groups with fewer than two distinct trajectories (after de-duplication) are returned unchanged
with a log line and no judge call: there is nothing to compare, and a constant score gives GRPO
no signal. Pass ``judge_single=True`` to have such a group judged anyway (an absolute score).

The parts, each in its own module: ``config`` (which judge, and what a failure raises), ``prompt``
(the group rendered for the judge), ``reply`` (the verdict's shape and its validation),
``transport`` (the call to the judge, with retries), ``scoring`` (a group's rewards from the
verdict) and ``hook`` (the per-group hook a gather calls). Import from here.
"""

from rewards.ruler.config import JUDGMENT_FIGURES, JudgeConfig, JudgeError, judgment
from rewards.ruler.hook import ruler_hook
from rewards.ruler.prompt import DEFAULT_RUBRIC, JudgePrompt, build_judge_prompt, shorten
from rewards.ruler.reply import JudgeReply, JudgeScore, parse_reply, reply_format
from rewards.ruler.scoring import score_group

__all__ = [
    "DEFAULT_RUBRIC",
    "JUDGMENT_FIGURES",
    "JudgeConfig",
    "JudgeError",
    "JudgePrompt",
    "JudgeReply",
    "JudgeScore",
    "build_judge_prompt",
    "judgment",
    "parse_reply",
    "reply_format",
    "ruler_hook",
    "score_group",
    "shorten",
]
