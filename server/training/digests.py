"""What makes two job submissions under one idempotency key the same: a digest of the body."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterator

from protocol.jobs import RLJob, SessionJob, SFTJob


def body_hash(request: RLJob | SFTJob | SessionJob) -> str:
    """What makes two submissions under one key the same (a session job: its body as sent, not
    the groups assembled from its sessions, which expire)."""
    # Dumped a group at a time and hashed as encoded, chunk by chunk (the digest is json.dumps's):
    # a large job's body in one C call would hold the interpreter, and so the event loop, for a second.
    groups = getattr(request, "groups", None)
    payload = request.model_dump(mode="json", exclude={"idempotency_key", "groups"} if groups else {"idempotency_key"})
    if groups is not None:
        payload["groups"] = [g.model_dump(mode="json") for g in groups]
    if isinstance(request, RLJob):
        # A trajectory sent without start_time got the server's clock as its default: that must not
        # make a byte-identical retry (curl, other languages) look like another submission.
        for group, sent in zip(request.groups, payload["groups"]):
            for t, fields in zip(group.trajectories, sent["trajectories"]):
                if "start_time" not in t.model_fields_set:
                    fields.pop("start_time")
    digest = hashlib.sha256()
    for chunk in canonical_chunks(payload):
        digest.update(chunk.encode())
    return digest.hexdigest()[:32]


def canonical_chunks(payload: dict[str, Any]) -> Iterator[str]:
    """`json.dumps(payload, sort_keys=True)` in pieces, each list at the top level one item at a
    time: every piece is one short call of the C encoder. (The pure-Python `iterencode` took seconds
    for a 20 MiB job, competing for the interpreter with the event loop throughout.)"""
    yield "{"
    for i, key in enumerate(sorted(payload)):
        value = payload[key]
        yield ("" if i == 0 else ", ") + json.dumps(key) + ": "
        if isinstance(value, list):
            yield "["
            for j, item in enumerate(value):
                yield ("" if j == 0 else ", ") + json.dumps(item, sort_keys=True)
            yield "]"
        else:
            yield json.dumps(value, sort_keys=True)
    yield "}"
