"""A large body is taken in short calls, so that the event loop is not held up meanwhile
(bench/body_wait.py measures it): server/api/piecewise.py validates it item by item, with the
model and errors of validating it whole; server/training/jobs.py's digest encodes it an item at a
time, to the bytes of encoding it whole."""

from __future__ import annotations

import copy
import json

import pytest
from pydantic import ValidationError

from typing import Union

from protocol.jobs import RLJob, SessionJob, SFTJob
from protocol.trajectory import Trajectory, TrajectoryGroup
from server.api.piecewise import body_model, list_item_model, prevalidated

pytestmark = pytest.mark.unit


def _wire_choice(text: str) -> dict:
    return {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text},
            "logprobs": {"content": [{"token": "t", "logprob": -0.5, "bytes": [116], "top_logprobs": []}]}}


def _job(groups: int = 3, size: int = 2) -> dict:
    trajectory = {"messages_and_choices": [{"role": "user", "content": "hi"}, _wire_choice("ok")], "reward": 1.0,
                  "additional_histories": [{"messages_and_choices": [{"role": "user", "content": "sub"},
                                                                     _wire_choice("done")]}]}
    return {"groups": [{"trajectories": [dict(trajectory, reward=float(i)) for i in range(size)]}
                       for _ in range(groups)], "idempotency_key": "k"}


def _errors(exc: ValidationError) -> list[tuple]:
    return [(e["loc"], e["type"]) for e in exc.errors()]


def test_list_item_model_finds_lists_of_models_only():
    assert list_item_model(RLJob.model_fields["groups"].annotation) is TrajectoryGroup
    assert list_item_model(TrajectoryGroup.model_fields["trajectories"].annotation) is Trajectory
    assert list_item_model(TrajectoryGroup.model_fields["exceptions"].annotation) is None  # list[str]
    assert list_item_model(RLJob.model_fields["idempotency_key"].annotation) is None


def test_a_valid_body_validates_to_the_same_job():
    body = _job()
    whole = RLJob.model_validate(copy.deepcopy(body))
    value = prevalidated(RLJob, copy.deepcopy(body))
    assert all(isinstance(g, TrajectoryGroup) for g in value["groups"])
    assert all(isinstance(t, Trajectory) for g in value["groups"] for t in g.trajectories)
    assert RLJob.model_validate(value).model_dump(exclude={"groups": {"__all__": {"trajectories": {
        "__all__": {"start_time"}}}}}) == whole.model_dump(exclude={"groups": {"__all__": {"trajectories": {
            "__all__": {"start_time"}}}}})


@pytest.mark.parametrize("damage", [
    lambda b: b["groups"][1]["trajectories"][0].update(reward="lots"),
    lambda b: b["groups"][2]["trajectories"][1]["messages_and_choices"].append({"content": "no role"}),
    lambda b: b["groups"][0]["trajectories"][1]["additional_histories"][0].update(messages_and_choices=3),
    lambda b: b["groups"][0].update(value=float("inf")),
    lambda b: b.update(groups=[]),  # the job's own validator, which runs on the whole
])
def test_an_invalid_body_fails_with_the_errors_of_whole_validation(damage):
    body = _job()
    damage(body)
    with pytest.raises(ValidationError) as whole:
        RLJob.model_validate(copy.deepcopy(body))
    with pytest.raises(ValidationError) as piecewise:
        RLJob.model_validate(prevalidated(RLJob, copy.deepcopy(body)))
    assert _errors(piecewise.value) == _errors(whole.value)


def test_anything_but_an_object_is_left_to_whole_validation():
    assert prevalidated(RLJob, [1, 2]) == [1, 2]
    assert prevalidated(RLJob, {"groups": "many"}) == {"groups": "many"}


def test_the_body_model_of_a_discriminated_union_is_the_member_its_tag_names():
    jobs = Union[RLJob, SFTJob]  # the jobs route's body, told apart by `kind`
    assert body_model(jobs, "kind", {"kind": "rl"}) is RLJob
    assert body_model(jobs, "kind", {"kind": "sft"}) is SFTJob
    assert body_model(jobs, "kind", {"kind": "dpo"}) is None  # whole validation names the bad tag
    assert body_model(jobs, "kind", {}) is None
    assert body_model(jobs, None, {"kind": "rl"}) is None  # a union without a tag field: left whole
    assert body_model(SessionJob, None, {"groups": []}) is SessionJob


@pytest.mark.parametrize("payload", [
    {"groups": [{"b": 1.5, "a": [1, {"z": None, "y": "é\u2028"}]}, {"c": True}], "config": {"lr": 1e-4}, "kind": "rl"},
    {"conversations": [], "kind": "sft", "x": [[1, 2], []], "y": {}},
    {},
])
def test_the_digest_encodes_a_body_in_pieces_to_the_bytes_of_encoding_it_whole(payload):
    from server.training.digests import canonical_chunks

    assert "".join(canonical_chunks(payload)) == json.dumps(payload, sort_keys=True)
