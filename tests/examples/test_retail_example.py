"""The retail desk example, driven by hand (no agent model)."""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from openai.types.chat.chat_completion import Choice

from examples.retail import RetailEnv, RetailExample, make_example
from examples.retail.db import fresh_db, order_total
from examples.retail.tasks import RetailTask, all_tasks, eval_tasks, split_of, train_tasks
from examples.retail.tools import TOOL_SCHEMAS, WRITE_TOOLS
from examples.retail.user import STOP, LLMUser, ScriptedUser
from rollouts.env import ToolError

pytestmark = pytest.mark.unit

TASKS = all_tasks()


def first(kind: str) -> RetailTask:
    return next(t for t in TASKS if t.kind == kind)


def env_for(task: RetailTask, **kwargs) -> RetailEnv:
    return RetailEnv(task.to_task("train"), **kwargs)


class Agent:
    """Plays the assistant: appends its turns to the conversation the way a rollout does."""

    def __init__(self, env: RetailEnv):
        self.env = env
        self.messages = env.initial_messages()
        self.calls = 0

    async def call(self, name: str, **arguments):
        self.calls += 1
        call_id = f"call_{self.calls}"
        function = {"name": name, "arguments": json.dumps(arguments)}
        self.messages.append({"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": function}]})
        try:
            result = await self.env.call_tool(name, arguments)
            content = json.dumps(result)
        except ToolError as e:
            result, content = e, f"Error: {e}"
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        return result

    async def say(self, text: str) -> str | None:
        self.messages.append({"role": "assistant", "content": text})
        reply = await self.env.user_reply(self.messages)
        if reply is not None:
            self.messages.append({"role": "user", "content": reply})
        return reply

    async def solve(self, task: RetailTask) -> None:
        """The ground-truth actions, then an answer stating every required output."""
        for action in task.ground_truth_actions:
            await self.call(action.name, **action.arguments)
        await self.say("Done. " + " ".join(task.required_outputs))


# --- scoring -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["cancel", "modify", "return", "total"])
async def test_ground_truth_actions_earn_full_reward(kind):
    task = first(kind)
    env = env_for(task)
    agent = Agent(env)

    user_id = await agent.call("find_user_id_by_email", email=task.email)
    assert user_id == task.user_id
    await agent.call("get_order_details", order_id=task.order_id)
    await agent.solve(task)
    score = await env.score(agent.messages)
    assert score.reward == 1.0, score.logs
    assert score.logs == []
    assert score.metrics["state_match"] is True
    assert score.metrics["records_match_fraction"] == 1.0
    assert score.metrics["outputs_found_fraction"] == 1.0
    # Reads are not graded as actions: looking things up costs no precision.
    assert score.metrics["action_precision"] == 1.0 and score.metrics["action_recall"] == 1.0
    assert score.metrics["tool_errors"] == 0


async def test_scoring_reads_choices_as_a_rollout_records_them():
    task = first("cancel")
    env = env_for(task)
    action = task.ground_truth_actions[0]
    await env.call_tool(action.name, action.arguments)
    call = {"id": "c1", "type": "function", "function": {"name": action.name, "arguments": json.dumps(action.arguments)}}
    turns = [
        {"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": None, "tool_calls": [call]}},
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Cancelled."}},
    ]
    messages = env.initial_messages()
    messages += [Choice.model_validate(turns[0]), {"role": "tool", "tool_call_id": "c1", "content": "{}"}, Choice.model_validate(turns[1])]
    score = await env.score(messages)
    assert score.reward == 1.0 and score.metrics["action_recall"] == 1.0
    assert await env.user_reply(messages) is None


async def test_every_generated_task_is_solvable():
    for task in TASKS:
        env = env_for(task)
        agent = Agent(env)
        await agent.solve(task)
        score = await env.score(agent.messages)
        assert score.reward == 1.0, (task.id, score.logs)


async def test_wrong_cancel_reason_gets_zero_with_a_readable_diff():
    task = first("cancel")
    right = task.ground_truth_actions[0].arguments["reason"]
    wrong = next(r for r in ("no longer needed", "ordered by mistake") if r != right)
    env = env_for(task)
    agent = Agent(env)
    await agent.call("cancel_pending_order", order_id=task.order_id, reason=wrong)
    await agent.say("Your order is cancelled.")
    score = await env.score(agent.messages)
    assert score.reward == 0.0
    assert score.metrics["state_match"] is False
    assert score.metrics["records_match_fraction"] == 0.0  # the one record the task is about is wrong
    assert score.metrics["action_precision"] == 0.0 and score.metrics["action_recall"] == 0.0
    assert f"db: orders/{task.order_id}.cancel_reason: expected {right!r}, got {wrong!r}" in score.logs
    assert any(line.startswith("unexpected action: cancel_pending_order") for line in score.logs)
    assert any(line.startswith("missing action: cancel_pending_order") for line in score.logs)


async def test_doing_nothing_scores_zero_on_a_write_task():
    task = first("return")
    env = env_for(task)
    agent = Agent(env)
    await agent.say("I have returned your items.")
    score = await env.score(agent.messages)
    assert score.reward == 0.0
    assert score.metrics["records_match_fraction"] == 0.0
    assert score.metrics["action_recall"] == 0.0
    assert any(f"orders/{task.order_id}.status: expected 'return requested', got 'delivered'" in l for l in score.logs)


async def test_total_task_needs_the_number_in_the_answer():
    task = first("total")
    total = task.required_outputs[0]
    env = env_for(task)
    agent = Agent(env)
    await agent.say("Your order costs a reasonable amount.")
    score = await env.score(agent.messages)
    assert score.reward == 0.0
    assert score.metrics["state_match"] is True and score.metrics["outputs_found_fraction"] == 0.0
    assert score.logs == [f"missing output: {total!r}"]
    # Written as money in a later answer, it counts.
    await agent.say(f"The total is ${total}.")
    assert (await env.score(agent.messages)).reward == 1.0


async def test_right_state_plus_a_stray_write_is_zero():
    task = first("cancel")
    other = next(t for t in TASKS if t.kind == "cancel" and t.order_id != task.order_id)
    env = env_for(task)
    agent = Agent(env)
    await agent.solve(task)
    await agent.call("cancel_pending_order", order_id=other.order_id, reason="no longer needed")
    score = await env.score(agent.messages)
    assert score.reward == 0.0
    assert score.metrics["records_match_fraction"] == 0.5
    assert score.metrics["action_precision"] == 0.5 and score.metrics["action_recall"] == 1.0


# --- tool rules ----------------------------------------------------------------------------


def _order_with_status(db, status):
    return next(o for o in db["orders"].values() if o["status"] == status)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda db: ("cancel_pending_order", {"order_id": _order_with_status(db, "delivered")["order_id"], "reason": "no longer needed"}), "only pending orders can be cancelled"),
        (lambda db: ("cancel_pending_order", {"order_id": _order_with_status(db, "cancelled")["order_id"], "reason": "no longer needed"}), "is cancelled"),
        (lambda db: ("return_delivered_order_items", {"order_id": (o := _order_with_status(db, "pending"))["order_id"], "item_ids": [o["items"][0]["item_id"]]}), "only delivered orders can be returned"),
        (lambda db: ("return_delivered_order_items", {"order_id": _order_with_status(db, "delivered")["order_id"], "item_ids": ["0000000000"]}), "items not in order"),
        (lambda db: ("return_delivered_order_items", {"order_id": _order_with_status(db, "delivered")["order_id"], "item_ids": []}), "at least one item"),
        (lambda db: ("cancel_pending_order", {"order_id": _order_with_status(db, "pending")["order_id"], "reason": "bored"}), "reason must be one of"),
        (lambda db: ("cancel_pending_order", {"order_id": _order_with_status(db, "pending")["order_id"]}), "missing arguments ['reason']"),
        (lambda db: ("get_order_details", {"order_id": 1234567}), "order_id must be a string"),
        (lambda db: ("get_order_details", {"order_id": _order_with_status(db, "pending")["order_id"].lstrip("#")}), "order ids start with '#W'"),
        (lambda db: ("get_order_details", {"order_id": "#W0", "verbose": True}), "unknown arguments ['verbose']"),
        (lambda db: ("find_user_id_by_email", {"email": "nobody@example.com"}), "no user with email"),
        (lambda db: ("delete_everything", {}), "unknown tool 'delete_everything'"),
    ],
)
async def test_rule_violations_raise_tool_error_and_change_nothing(call, message):
    env = env_for(first("cancel"))
    name, arguments = call(env.db)
    before = json.dumps(env.db, sort_keys=True)
    with pytest.raises(ToolError, match=message.replace("[", r"\[").replace("]", r"\]")):
        await env.call_tool(name, arguments)
    assert json.dumps(env.db, sort_keys=True) == before
    assert env.tool_errors == 1


def _modify_setup(db):
    order = _order_with_status(db, "pending")
    line = order["items"][0]
    product = db["products"][line["product_id"]]
    siblings = [db["items"][i] for i in product["item_ids"] if i != line["item_id"]]
    other_product = next(p for p in db["products"].values() if p["product_id"] != line["product_id"])
    return order, line, siblings, other_product


async def test_modify_rules():
    env = env_for(first("modify"))
    order, line, siblings, other_product = _modify_setup(env.db)
    oid = order["order_id"]
    with pytest.raises(ToolError, match="not another option"):
        await env.call_tool("modify_pending_order_items", {"order_id": oid, "item_ids": [line["item_id"]], "new_item_ids": [other_product["item_ids"][0]]})
    with pytest.raises(ToolError, match="already in the order"):
        await env.call_tool("modify_pending_order_items", {"order_id": oid, "item_ids": [line["item_id"]], "new_item_ids": [line["item_id"]]})
    with pytest.raises(ToolError, match="same length"):
        await env.call_tool("modify_pending_order_items", {"order_id": oid, "item_ids": [line["item_id"]], "new_item_ids": []})
    for sibling in siblings:
        sibling["available"] = False
    with pytest.raises(ToolError, match="is not available"):
        await env.call_tool("modify_pending_order_items", {"order_id": oid, "item_ids": [line["item_id"]], "new_item_ids": [siblings[0]["item_id"]]})
    delivered = _order_with_status(env.db, "delivered")
    with pytest.raises(ToolError, match="only pending orders can be modified"):
        await env.call_tool("modify_pending_order_items", {"order_id": delivered["order_id"], "item_ids": [delivered["items"][0]["item_id"]], "new_item_ids": ["x"]})


async def test_modify_charges_the_price_difference():
    env = env_for(first("modify"))
    order, line, siblings, _ = _modify_setup(env.db)
    new = siblings[0]
    new["available"] = True
    before = order_total(order)
    result = await env.call_tool("modify_pending_order_items", {"order_id": order["order_id"], "item_ids": [line["item_id"]], "new_item_ids": [new["item_id"]]})
    assert result["items"][0]["item_id"] == new["item_id"]
    difference = round(new["price"] - line["price"], 2)
    assert order_total(env.db["orders"][order["order_id"]]) == pytest.approx(before + difference)
    last = result["payment_history"][-1]
    assert last["transaction_type"] == ("payment" if difference > 0 else "refund")
    assert last["amount"] == pytest.approx(abs(difference))


async def test_cancel_refunds_what_was_paid():
    task = first("cancel")
    env = env_for(task)
    result = await env.call_tool("cancel_pending_order", {"order_id": task.order_id, "reason": "no longer needed"})
    assert result["status"] == "cancelled"
    assert result["payment_history"][-1] == {
        "transaction_type": "refund",
        "amount": order_total(result),
        "payment_method_id": result["payment_method_id"],
    }


async def test_tool_results_are_copies():
    task = first("total")
    env = env_for(task)
    result = await env.call_tool("get_order_details", {"order_id": task.order_id})
    result["status"] = "tampered"
    assert env.db["orders"][task.order_id]["status"] != "tampered"


# --- isolation and tasks -------------------------------------------------------------------


async def test_two_envs_for_one_task_share_no_state():
    task = first("cancel")
    a, b = env_for(task), env_for(task)
    await a.call_tool("cancel_pending_order", {"order_id": task.order_id, "reason": "no longer needed"})
    assert a.db["orders"][task.order_id]["status"] == "cancelled"
    assert b.db["orders"][task.order_id]["status"] == "pending"
    assert env_for(task).db["orders"][task.order_id]["status"] == "pending"  # the generator's cache is untouched
    assert fresh_db()["orders"][task.order_id]["status"] == "pending"


def test_tasks_are_deterministic_and_splits_disjoint_by_order():
    assert [t.id for t in train_tasks(0)] == [t.id for t in train_tasks(0)]
    assert [t.id for t in train_tasks(0)] != [t.id for t in train_tasks(1)]
    assert sorted(t.id for t in train_tasks(0)) == sorted(t.id for t in train_tasks(1))
    assert [t.model_dump() for t in eval_tasks()] == [t.model_dump() for t in eval_tasks()]
    train_orders = {t.data["order_id"] for t in train_tasks(0)}
    eval_orders = {t.data["order_id"] for t in eval_tasks()}
    assert train_orders and eval_orders and not train_orders & eval_orders
    assert len(train_tasks(0)) + len(eval_tasks()) == len(TASKS)
    assert len({t.id for t in TASKS}) == len(TASKS)
    assert all(split_of(o) == "eval" for o in eval_orders)
    assert len(train_tasks(3, n=5)) == 5


def test_tasks_cover_every_kind_and_write_only_ground_truth():
    assert {t.kind for t in TASKS} == {"cancel", "modify", "return", "total"}
    for t in TASKS:
        assert all(a.name in WRITE_TOOLS for a in t.ground_truth_actions)
        assert (t.kind == "total") == bool(t.required_outputs)


def test_a_task_from_another_database_is_refused():
    task = first("cancel").model_copy(update={"expected_state_hash": "0" * 64})
    with pytest.raises(ValueError, match="different database"):
        env_for(task)


def test_make_example():
    example = make_example(train_size=7)
    assert isinstance(example, RetailExample) and example.name == "retail"
    assert example.settings.max_turns == 12
    assert len(example.train_tasks(0)) == 7
    assert example.eval_tasks() and all(t.metadata["split"] == "eval" for t in example.eval_tasks())
    env = example.make_env(example.eval_tasks()[0])
    assert isinstance(env, RetailEnv)
    names = {s["function"]["name"] for s in env.tools}
    assert names == {s["function"]["name"] for s in TOOL_SCHEMAS} and WRITE_TOOLS <= names
    assert env.initial_messages()[0]["role"] == "system"
    assert env.initial_messages()[1] == {"role": "user", "content": RetailTask.from_task(example.eval_tasks()[0]).request}
    with pytest.raises(TypeError):
        make_example(no_such_option=1)


def test_examples_and_rewards_stay_light():
    code = (
        "import sys, examples.retail, rewards\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'server', 'litellm')]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- scripted user -------------------------------------------------------------------------


def test_scripted_user_answers_by_keyword():
    task = first("cancel")
    user = ScriptedUser(task, goal_reached=lambda messages: False)
    reason = task.ground_truth_actions[0].arguments["reason"]
    assert user.respond_to("Could you please give me your email address?") == f"My email is {task.email}."
    assert user.respond_to("Which order would you like to cancel?") == f"It's order {task.order_id}."
    assert user.respond_to("What is the reason: 'no longer needed' or 'ordered by mistake'?") == f"{task.reason}."
    confirm = f"I will cancel order {task.order_id} with reason '{reason}'. Shall I proceed?"
    assert user.respond_to(confirm) == "Yes, please go ahead."
    wrong = next(r for r in ("no longer needed", "ordered by mistake") if r != reason)
    assert user.respond_to(f"I will cancel it with reason '{wrong}'. Confirm?") == f"{task.reason}."
    assert user.respond_to("The weather is nice.") == f"Sorry, let me repeat: {task.request}"


async def test_scripted_user_is_deterministic_and_stops():
    task = first("cancel")
    conversation = [
        {"role": "system", "content": "..."},
        {"role": "user", "content": task.request},
        {"role": "assistant", "content": "Sure. What's your email?"},
    ]
    replies = {await ScriptedUser(task, lambda m: False).reply(conversation) for _ in range(3)}
    assert replies == {f"My email is {task.email}."}
    assert await ScriptedUser(task, lambda m: True).reply(conversation) is None
    long = conversation + [{"role": "user", "content": "hm"}, {"role": "assistant", "content": "Your email?"}] * 6
    assert await ScriptedUser(task, lambda m: False, max_replies=6).reply(long) is None


async def test_full_conversation_with_the_scripted_user():
    task = first("cancel")
    reason = task.ground_truth_actions[0].arguments["reason"]
    env = env_for(task)
    agent = Agent(env)

    assert await agent.say("I can help. What is your email?") == f"My email is {task.email}."
    await agent.call("find_user_id_by_email", email=task.email)
    await agent.call("get_order_details", order_id=task.order_id)
    assert await agent.say("Why do you want to cancel? What is the reason?") == f"{task.reason}."
    assert await agent.say(f"Cancel {task.order_id}, reason '{reason}'. Do you confirm?") == "Yes, please go ahead."
    await agent.call("cancel_pending_order", order_id=task.order_id, reason=reason)
    assert await agent.say("Your order is cancelled.") is None  # goal reached: the user leaves
    score = await env.score(agent.messages)
    assert score.reward == 1.0 and score.metrics["action_precision"] == 1.0


async def test_total_task_user_stops_only_once_told_the_total():
    task = first("total")
    env = env_for(task)
    agent = Agent(env)
    assert await agent.say("Let me check. Can I have your email?") == f"My email is {task.email}."
    assert (await agent.say("It is fine.")).startswith("Sorry, let me repeat")
    assert await agent.say(f"The total is ${task.required_outputs[0]}.") is None


# --- LLM user through litellm against a local OpenAI-compatible server ----------------------


class FakeChatServer:
    """The smallest OpenAI-compatible chat endpoint: records requests, answers a fixed text."""

    def __init__(self, reply: str):
        self.reply = reply
        self.requests: list[dict] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                payload = json.dumps(
                    {
                        "id": "chatcmpl-test",
                        "object": "chat.completion",
                        "created": 0,
                        "model": body.get("model", "x"),
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": owner.reply}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def chat_server(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    server = FakeChatServer("My email is written on my card, one moment.")
    yield server
    server.close()


async def test_llm_user_sees_the_conversation_from_the_other_side(chat_server):
    task = first("cancel")
    env = env_for(task, user_model="openai/whatever", user_api_base=chat_server.url, user_api_key="test-key")
    assert isinstance(env.user, LLMUser)
    agent = Agent(env)

    await agent.call("get_order_details", order_id=task.order_id)
    assert await agent.say("Hello! What is your email?") == "My email is written on my card, one moment."
    (request,) = chat_server.requests
    assert request["path"] == "/v1/chat/completions"
    assert request["auth"] == "Bearer test-key"
    body = request["body"]
    assert body["model"] == "whatever"
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "user"]  # tool traffic hidden, roles swapped
    assert task.email in body["messages"][0]["content"] and task.reason in body["messages"][0]["content"]
    assert body["messages"][2]["content"] == task.request
    assert body["messages"][3]["content"] == "Hello! What is your email?"


async def test_llm_user_stop_token_ends_the_conversation(chat_server, monkeypatch):
    chat_server.reply = f"Thanks, that's all. {STOP}"
    monkeypatch.setenv("ARTISAN_USER_MODEL", "openai/whatever")
    monkeypatch.setenv("ARTISAN_USER_API_BASE", chat_server.url)
    monkeypatch.setenv("OPENAI_API_KEY", "test-key")
    env = env_for(first("total"))
    assert isinstance(env.user, LLMUser) and env.user.api_base == chat_server.url
    agent = Agent(env)
    assert await agent.say("The total is $1.") is None
    assert len(chat_server.requests) == 1


async def test_llm_user_empty_reply_is_an_infrastructure_error(chat_server):
    chat_server.reply = ""
    env = env_for(first("total"), user_model="openai/whatever", user_api_base=chat_server.url, user_api_key="k")
    with pytest.raises(RuntimeError, match="empty message"):
        await Agent(env).say("Hello?")


def test_scripted_user_without_a_user_model(monkeypatch):
    monkeypatch.delenv("ARTISAN_USER_MODEL", raising=False)
    assert isinstance(env_for(first("total")).user, ScriptedUser)
