"""A run's trajectories out as JSONL and into another run, token ids and logprobs intact, and
trained on again there without a single prompt mismatch."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from client import ServerError, TrainableModel
from client.jsonl import download_jsonl, groups_from_jsonl, import_jsonl, read_jsonl
from protocol.choices import choice_logprobs, choice_token_ids
from tests.helpers import demo_groups, with_rewards


def _tokens(groups):
    return [(choice_token_ids(c), choice_logprobs(c), c.sampling) for g in groups for t in g.trajectories for c in t.choices()]


async def test_export_import_and_train_again(server, tmp_path):
    src = await TrainableModel("jsonl-src").register(server.url)
    rng = random.Random(3)
    trained = with_rewards(await demo_groups(src, 2, 3, seed=31), [[rng.random() for _ in range(3)] for _ in range(2)])
    first = await src.train(trained)
    assert first.trained and first.step == 1
    evals = await demo_groups(src, 1, 2, seed=32)
    await src.log(evals, split="val")

    path = await download_jsonl(src, tmp_path / "src.jsonl")
    records = read_jsonl(path)
    assert len(records) == 8
    assert {(r["step"], r["split"]) for r in records} == {(1, "train"), (1, "val")}
    assert {r["run"] for r in records} == {"jsonl-src"}
    assert (await download_jsonl(src, split="val")).count("\n") == 2  # filters reach the server

    # What comes back is what was trained: same groups, same order, same tokens and logprobs.
    back = groups_from_jsonl(path)  # split="train" by default
    assert [len(g.trajectories) for g in back] == [3, 3]
    assert [t.reward for g in back for t in g.trajectories] == [t.reward for g in trained for t in g.trajectories]
    assert _tokens(back) == _tokens(trained)
    assert [g.metadata for g in back] == [{"step": 1, "group_index": 0}, {"step": 1, "group_index": 1}]

    dst = await TrainableModel("jsonl-dst").register(server.url)
    stored = await import_jsonl(dst, path)
    assert stored == {"stored": 8, "steps": [1], "splits": ["train", "val"]}
    async with httpx.AsyncClient(base_url=server.url) as http:
        src_rows = (await http.get("/v1/runs/jsonl-src/trajectories")).json()["data"]
        dst_rows = (await http.get("/v1/runs/jsonl-dst/trajectories")).json()["data"]
        key = lambda r: (r["step"], r["split"], r["group_index"], r["traj_index"])  # noqa: E731
        assert [r["data"] for r in sorted(dst_rows, key=key)] == [r["data"] for r in sorted(src_rows, key=key)]
        run = (await http.get("/v1/runs/jsonl-dst")).json()
        assert run["step"] == 0 and run["steps"] == []  # imported, not trained: no step was made

        # The destination's own export now holds the same trajectories.
        again = groups_from_jsonl(await download_jsonl(dst))
        assert _tokens(again) == _tokens(trained)

        result = await dst.train(again)
        m = result.metrics.model_dump()
        assert result.trained and result.step == 1
        assert m["prompt_mismatches"] == 0 and m["trained_choices"] == m["choices"] > 0

        # A broken line is refused with its line number, and nothing of the body is stored.
        good = path.read_text().splitlines()[0]
        with pytest.raises(ServerError, match="line 2"):
            await import_jsonl(dst, good + "\n{\"step\": 1}\n")
        with pytest.raises(ServerError, match="line 1"):
            await import_jsonl(dst, "{not json\n")
        with pytest.raises(ServerError, match="line 1: trajectory.messages_and_choices"):
            await import_jsonl(dst, '{"trajectory": {"messages_and_choices": [{"content": "no role"}]}}\n')
        # 8: the trained step 1 replaced its train rows with what it trained (the same six).
        assert len((await http.get("/v1/runs/jsonl-dst/trajectories")).json()["data"]) == 8
        nope = TrainableModel("nope")
        nope.server_url = server.url
        with pytest.raises(ServerError, match="does not exist"):
            await import_jsonl(nope, path)

    # `split` relabels on import, so imported rows never mix with a run's own.
    relabeled = await import_jsonl(dst, json.dumps(records[0]) + "\n", split="imported")
    assert relabeled["splits"] == ["imported"]
