"""Which message fields a recorded session keeps: those the served model's chat template may
render, and those the server reads itself. A field no template reads changes no prompt, so keeping
it would only spend memory (a harness's 4 MiB of metadata per message, recorded 60 times)."""

from __future__ import annotations

from typing import Any

import jinja2
from jinja2 import nodes

# Message fields the server reads itself, whatever the template: the turn identity of
# protocol/histories.py (reasoning included) and the sampled ids the turn cache splices by.
SERVER_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "token_ids",
                           "reasoning_content", "reasoning"})

PROBE_FIELD = "artisan_probe_field"  # a field no template names: if it shows, the template prints whole messages


def template_fields(source: str | None) -> frozenset[str] | None:
    """Every name a chat template reads as an attribute or a quoted key (`message.thinking`,
    `m['tool_calls']`): a message field it never names cannot change a prompt. None when the
    template cannot be parsed here (then every field is kept: better kept than a prompt changed)."""
    if not source:
        return None
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"]).parse(source)
    except jinja2.TemplateError:
        return None
    names = {n.attr for n in tree.find_all(nodes.Getattr)}
    names |= {n.arg.value for n in tree.find_all(nodes.Getitem)
              if isinstance(n.arg, nodes.Const) and isinstance(n.arg.value, str)}
    return frozenset(names)


def rendered_fields(template: Any) -> frozenset[str] | None:
    """The message fields a chat template (server/chat/template.py's ChatTemplate) may render: the
    names it reads, unless a probe shows that it prints fields it does not name (`message | tojson`,
    a loop over a message's items); None, keep every field, then or when the probe fails."""
    names = template_fields(getattr(template, "source", None))
    if names is None:
        return None
    probe = "ARTISANPROBEFIELDQ"
    conversation = [{"role": "user", "content": "hi", PROBE_FIELD: probe},
                    {"role": "assistant", "content": "ok", PROBE_FIELD: probe},
                    {"role": "user", "content": "more", PROBE_FIELD: probe}]
    try:
        shown = template.render(conversation, None, True)
    except Exception:  # a template that refuses the probe tells nothing: keep every field
        return None
    return None if probe in shown else names


def kept_message(message: dict[str, Any], kept: frozenset[str] | None) -> dict[str, Any]:
    """The message as recorded: the fields a template or the server reads (all, when unknown)."""
    return dict(message) if kept is None else {k: v for k, v in message.items() if k in kept}
