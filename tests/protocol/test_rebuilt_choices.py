"""Choices that reach a training job without the server's token ids, as ART-style code produces
them: a streamed completion rebuilt from its chunks, litellm's own Choice objects, a sub-agent's
additional history. Each is matched to what this server sampled and trained token-exactly; a turn
the server never sampled is context, and counted.
"""

from __future__ import annotations

from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_message import ChatCompletionMessage

from client import History, TrainConfig, TrainableModel, Trajectory, TrajectoryGroup
from protocol.offline import import_litellm

PROMPTS = ["Name a colour.", "Name a fruit.", "Name a city."]


async def _streamed_choice(client, model: str, messages: list[dict], seed: int) -> tuple[Choice, list[int]]:
    """What a client holds after a streamed completion: the text and finish reason, rebuilt."""
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=8, seed=seed, stream=True)
    content, finish, ids, sampling = "", None, [], None
    async for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            ids += (c.model_extra or {}).get("token_ids") or []
            sampling = (c.model_extra or {}).get("sampling") or sampling
    assert sampling is not None and ids  # the stream carries the record, for clients that keep it
    return Choice(index=0, finish_reason=finish, message=ChatCompletionMessage(role="assistant", content=content)), ids


async def test_streamed_and_litellm_choices_are_recovered_and_trained_exactly(server):
    litellm = import_litellm()

    model = await TrainableModel("rebuilt").register(server.url)
    trajs = []
    async with model.openai_client(max_retries=0) as client:
        for seed, prompt in enumerate(PROMPTS):
            messages = [{"role": "user", "content": prompt}]
            streamed, _ = await _streamed_choice(client, model.name, messages, seed)
            traj = Trajectory(messages_and_choices=[*messages, streamed, {"role": "user", "content": "Another."}])
            resp = await litellm.acompletion(model=f"hosted_vllm/{model.name}", messages=traj.messages(),
                                             api_base=server.url + "/v1", api_key="x", max_tokens=8, seed=seed)
            lite = resp.choices[0]
            # litellm's Choice, brought to OpenAI's shape as ART's convert_litellm_choice_to_openai does
            traj.messages_and_choices.append(Choice(
                index=0, finish_reason=lite.finish_reason,
                message=ChatCompletionMessage(role="assistant", content=lite.message.content),
                logprobs=ChoiceLogprobs(content=None)))
            # a sub-agent's conversation, its turn sampled by the server and kept as it came
            sub = await client.chat.completions.create(model=model.name, max_tokens=6, seed=seed + 50,
                                                       messages=[{"role": "user", "content": "Summarise."}])
            traj.additional_histories.append(History(messages_and_choices=[
                {"role": "user", "content": "Summarise."}, sub.choices[0]]))
            traj.reward = float(seed)
            trajs.append(traj)
    never = Choice(index=0, finish_reason="stop",
                   message=ChatCompletionMessage(role="assistant", content="text this server never sampled"))
    trajs[0].messages_and_choices[-1] = never
    result = await model.train([TrajectoryGroup(trajectories=trajs)], TrainConfig(learning_rate=1e-3))
    m = result.metrics
    assert result.trained, result.warnings
    assert m.choices == 9 and m.unsampled_choices == 1 and m.recovered_choices == 5
    assert m.trained_choices == 8 and m.prompt_mismatches == 0, {k: v for k, v in m.model_dump().items() if v}
    assert m.additional_histories == 3
    assert m.logprob_gap <= 1e-3
    assert any("not sampled by this server" in w for w in result.warnings)
