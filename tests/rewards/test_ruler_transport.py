"""RULER over real transports: an art-server as the judge, and `client.train --reward ruler`."""

from __future__ import annotations

import json
import re

import pytest
from fastapi import FastAPI, Request

from client import Trajectory, TrajectoryGroup
from rewards.ruler import JudgeConfig, JudgeError, score_group
from tests.helpers import ServedApp, train_cli


def _group() -> TrajectoryGroup:
    base = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Cancel order 7."}]
    return TrajectoryGroup(trajectories=[
        Trajectory(messages_and_choices=base + [{"role": "assistant", "content": answer}], reward=0.0)
        for answer in ("Done, order 7 is cancelled.", "I cannot help with that.")])


async def test_art_server_as_judge_endpoint_malformed_answer_is_a_judge_failure(server):
    judge = JudgeConfig(model="artisan-tiny", base_url=server.url + "/v1", max_tokens=16)
    with pytest.raises(JudgeError) as info:
        await score_group(_group(), judge, max_retries=1, backoff_s=0.0)
    # the tiny model's reply came back and was refused as a judgment, twice
    assert info.value.attempts == 2
    assert re.search(r"JSON|json|scores|empty", str(info.value))


async def test_unknown_judge_model_on_art_server_is_not_retried_forever(server):
    judge = JudgeConfig(model="no-such-model", base_url=server.url + "/v1")
    with pytest.raises(JudgeError, match="404|does not exist"):
        await score_group(_group(), judge, max_retries=1, backoff_s=0.0)


class _FairJudge:
    """A loopback judge that scores every trajectory id in the prompt (no hosted LLM here)."""

    def __init__(self) -> None:
        self.calls = 0
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            prompt = "\n".join(m.get("content") or "" for m in body["messages"])
            ids = sorted(set(re.findall(r"\bt\d+\b", prompt)), key=lambda x: int(x[1:]))
            self.calls += 1
            scores = [{"trajectory_id": i, "explanation": "ok", "score": round(0.2 + 0.6 * (k % 2), 2)}
                      for k, i in enumerate(ids)]
            return {"id": "j", "object": "chat.completion", "created": 0, "model": "judge",
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": json.dumps({"scores": scores})}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

        self.served = ServedApp(app).start()


def test_train_cli_uses_ruler_instead_of_the_environment_reward(fresh_server, tmp_path):
    srv = fresh_server()
    judge = _FairJudge()
    try:
        proc = train_cli(srv.url, tmp_path, "ruler-retail", "--example", "retail", "--reward", "ruler",
                         "--judge", f"{judge.served.url}/v1#judge", "--steps", "1", "--groups-per-step", "2",
                         "--group-size", "2", "--eval-tasks", "2", "--eval-every", "0", "--max-turns", "2",
                         "--max-tokens", "24", "--seed", "0")
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        # One judgment per training group. Seeded: unseeded, a group's two rollouts were now and then
        # the same text, which RULER does not send to the judge (nothing to compare).
        assert judge.calls >= 2
        history = json.loads((tmp_path / "summary.json").read_text())["history"]
        # the judge's 0.2/0.8 split is the reward the step trained on, not the env's all-zero reward
        assert history[0]["reward_mean"] == pytest.approx(0.5)
        assert history[0]["groups_trainable"] == 2
    finally:
        judge.served.stop()
