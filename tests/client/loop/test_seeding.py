"""`client.train --seed N`: the same command gives the same curve (rollouts/seeding.py).

Two runs of one seed on one server (two run names, each from the same LoRA init) must sample the
same tokens, train the same step and evaluate the same; the members of a group must still differ,
and without a seed two runs sample differently.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from client.errors import RunCannotLearn
from client.loop.training_loop import train_loop
from client.loop.config import LoopConfig
from rollouts.seeding import derive_seed, next_request_seed, seeded


@pytest.mark.unit
async def test_derived_seeds_are_stable_distinct_and_per_rollout():
    assert derive_seed(7, "train", "0", 3) == derive_seed(7, "train", "0", 3)
    assert len({derive_seed(7, "train", "0", i) for i in range(64)}) == 64
    assert all(0 <= derive_seed(s) < 2**63 for s in range(100))

    async def calls(seed):
        return [next_request_seed() for _ in range(3)]

    a, b, none = await asyncio.gather(seeded(calls(None), 1), seeded(calls(None), 1), seeded(calls(None), None))
    assert a == b and len(set(a)) == 3  # each turn of a rollout its own seed, the same on every run
    assert none == [None] * 3
    assert next_request_seed() is None  # outside a seeded rollout: unseeded, as before


def _sampled(url: str, run: str) -> list[list[int]]:
    """Every stored trajectory's sampled token ids, turn by turn (training and evaluation)."""
    rows = httpx.get(f"{url}/v1/runs/{run}/trajectories", timeout=30)
    rows.raise_for_status()
    return sorted([c["token_ids"] for c in r["data"]["messages_and_choices"] if isinstance(c, dict) and "token_ids" in c]
                  for r in rows.json()["data"])


async def test_a_seeded_run_repeats_its_curve_and_an_unseeded_one_does_not(fresh_server, tmp_path):
    srv = fresh_server()

    async def run(name: str, seed: int | None) -> dict:
        cfg = LoopConfig(server=srv.url, run=name, example="demo", steps=1, groups_per_step=2, group_size=4,
                         eval_every=0, eval_tasks=8, seed=seed, out=tmp_path / name, progress=False, patience=5,
                         train={"learning_rate": 1e-3})
        return await train_loop(cfg)

    first, second = await run("seeded-a", 7), await run("seeded-b", 7)
    assert [e["reward"] for e in first["evals"]] == [e["reward"] for e in second["evals"]]
    figures = ("reward_mean", "reward_std", "trainable_tokens", "groups_trainable")
    assert [[h.get(k) for k in figures] for h in first["history"]] == \
           [[h.get(k) for k in figures] for h in second["history"]]
    a, b = _sampled(srv.url, "seeded-a"), _sampled(srv.url, "seeded-b")
    assert a and a == b  # token for token
    # A group's members were seeded apart: not every rollout of a task sampled the same tokens.
    assert len({tuple(map(tuple, t)) for t in a}) > 2

    # Unseeded, the draw may score 0 everywhere and stop as hopeless after one attempt; its held-out
    # samples are logged before that stop, and they are what this compares.
    with contextlib.suppress(RunCannotLearn):
        await run("unseeded", None)
    unseeded = _sampled(srv.url, "unseeded")
    assert unseeded and unseeded != a


async def test_a_seeded_run_with_dynamic_sampling_repeats_the_groups_it_sets_aside(fresh_server, tmp_path, capsys):
    """Groups of two of the demo's policy often score alike (both solved or both failed): those are
    sampled again in place, the step line says how many, and a second run of the seed sets aside the same ones."""
    srv = fresh_server()

    async def run(name: str) -> dict:
        cfg = LoopConfig(server=srv.url, run=name, example="demo", steps=2, groups_per_step=2, group_size=2,
                         eval_every=0, eval_tasks=4, seed=3, out=tmp_path / name, progress=False, patience=5,
                         dynamic_sampling=8, train={"learning_rate": 1e-3})
        return await train_loop(cfg)

    first, second = await run("aside-a"), await run("aside-b")
    figures = ("groups_set_aside", "reward_mean_sampled", "reward_mean", "groups_total", "groups_trainable")
    history = [[h.get(k) for k in figures] for h in first["history"]]
    assert history == [[h.get(k) for k in figures] for h in second["history"]]
    assert sum(h["groups_set_aside"] for h in first["history"]) > 0
    for h in first["history"]:  # below the cap, a batch holds only groups with signal
        assert h["groups_set_aside"] == 8 or h["groups_trainable"] == h["groups_total"] == 2
    assert _sampled(srv.url, "aside-a") == _sampled(srv.url, "aside-b")
    assert "set aside (scored alike)" in capsys.readouterr().out
