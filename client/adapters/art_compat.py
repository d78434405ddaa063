"""Code written for OpenPipe ART, trained by art-server: change the backend, keep the rest.

    import art
    from client.adapters.art_compat import ArtisanBackend

    backend = ArtisanBackend("http://gpu-box:8000", api_key="...")
    model = art.TrainableModel(name="agent-1", project="demo", base_model="Qwen/Qwen2.5-7B-Instruct")
    await model.register(backend)
    ...  # ART's own rollouts, gather_trajectory_groups, RULER
    result = await backend.train(model, groups)          # ART's keywords, ART's meanings

Implements `art.Backend` of openpipe-art 0.5.x (`pip install -e '.[art]'`). `train` takes ART's
keyword arguments and gives them ART's meaning: its loss names and their epsilon defaults (cispo:
1.0 / 4.0, ppo: 0.2), `normalize_advantages` and `scale_rewards`. An argument whose meaning
art-server cannot reproduce raises with its name when given a non-default value; never ignored.
An omitted learning rate gets the server's default for the model, not ART's 5e-6.

Trajectories ART 0.5.23 captured (`art.trajectory(...)`, `with art.Trajectory()`: the HTTP
exchanges of the `openai` and `anthropic` SDKs, Chat Completions, Responses and Messages) train
like appended Choices: client/adapters/art_exchanges.py rebuilds their conversations.

ART's PipelineTrainer (`art.pipeline_trainer`, asynchronous training) runs on this backend
unchanged. Of the optional hooks it looks for, this backend has the ones art-server can honour:
`adapter_lease` and `exact_adapter_lease` pin the step a rollout samples from (inside the lease,
`model.get_inference_name()` names `name@step`, so a group is sampled by one step) and keep that
step's adapter loaded; `adapter_retention_lease` keeps it loaded; `prune_model_adapters` unloads
every other adapter on the server. ART drops groups staler than its `max_steps_off_policy`
itself, before they reach `train`. The trainer's constructor asks whether its backend is ART's
LocalBackend by importing that module, which imports torch; where torch is not installed no
LocalBackend can exist, so importing this module answers that question without it
(`_no_local_backend_without_torch`).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import math
import sys
import types
from collections import Counter
from typing import Any, AsyncIterator, Iterable

import art

from client.adapters import art_exchanges
from client.model import ServerError, TrainableModel
from protocol.config import SFTConfig, TrainConfig
from protocol.names import policy_name
from protocol.trajectory import Conversation, TrajectoryGroup

# ART's losses, with the clip bounds ART gives each when `epsilon` / `epsilon_high` are not set.
LOSSES = {"cispo": ("cispo", 1.0, 4.0), "ppo": ("ppo", 0.2, None)}
# Execution knobs of ART's own trainer: how it computes, not what it computes.
EXECUTION = {"verbose", "plot_tensors", "logprob_calculation_chunk_size", "packed_sequence_length",
             "precalculate_logprobs", "allow_training_without_logprobs", "save_checkpoint", "optimizer_save_interval"}
# What art-server cannot reproduce, with ART's default: accepted at that value only. ART's
# kl_penalty_coef reshapes advantages; art-server's KL is a loss term (TrainConfig.kl_coef).
UNSUPPORTED = {"loss_fn_config": None, "adam_params": None, "kl_penalty_reference_step": None,
               "kl_ref_adapter_path": None, "advantage_balance": 0.0, "importance_sampling_level": "token",
               "max_negative_advantage_importance_sampling_weight": None, "mask_prob_ratio": False,
               "kimi_k2_tau": None, "truncated_importance_sampling": None,
               "scale_learning_rate_by_reward_std_dev": False, "num_trajectories_learning_rate_multiplier_power": 0.0,
               "grad_accumulation_sequences": None, "kl_penalty_source": "current_learner",
               "kl_penalty_step_lag": None, "final_training_step": None, "kl_penalty_coef": 0.0}


class UnsupportedArgument(ValueError):
    pass


def train_config(learning_rate: float | None = None, loss_fn: str | None = None, ppo: bool | None = None,
                 epsilon: float | None = None, epsilon_high: float | None = None, normalize_advantages: bool = True,
                 scale_rewards: bool = True, **rest: Any) -> TrainConfig:
    """ART's `backend.train` keywords as art-server's TrainConfig."""
    for name, value in rest.items():
        if name in EXECUTION:
            continue
        if name not in UNSUPPORTED:
            raise UnsupportedArgument(f"{name}: not an argument of ART's backend.train that art-server knows")
        if value != UNSUPPORTED[name]:
            raise UnsupportedArgument(f"{name}={value!r}: art-server cannot train that way; leave it at "
                                      f"{UNSUPPORTED[name]!r}")
    name = loss_fn or ("ppo" if ppo else "cispo")
    if name not in LOSSES:
        raise UnsupportedArgument(f"loss_fn={name!r}: art-server trains with {' or '.join(LOSSES)}")
    loss, eps_default, high_default = LOSSES[name]
    low = eps_default if epsilon is None else epsilon
    high = epsilon_high if epsilon_high is not None else (high_default if high_default is not None else low)
    return TrainConfig(learning_rate=learning_rate, loss=loss, epsilon_low=low, epsilon_high=high,
                       scale_rewards=normalize_advantages and scale_rewards)


def _groups(groups: Iterable[Any]) -> list[TrajectoryGroup]:
    out = []
    for g in groups:
        dumped = g.model_dump(mode="json")
        dumped["exceptions"] = [e if isinstance(e, str) else f"{e.get('type')}: {e.get('message')}"
                                for e in dumped.get("exceptions") or []]
        dumped["trajectories"] = [_trajectory(t, d) for t, d in zip(g.trajectories, dumped["trajectories"])]
        out.append(TrajectoryGroup.model_validate(dumped))
    return out


def _trajectory(trajectory: Any, dumped: dict[str, Any]) -> dict[str, Any]:
    """ART 0.5.23 captures a rollout's HTTP exchanges instead of its messages and choices; their
    conversations are the trajectory's histories (client/adapters/art_exchanges.py)."""
    exchanges = getattr(trajectory, "exchanges", None)
    if not exchanges:
        return dumped
    if exchanges.completions:
        raise UnsupportedArgument("trajectory.exchanges.completions: raw Completions exchanges have no chat "
                                  "conversation to train; use Chat Completions, Responses or Messages")
    found = art_exchanges.histories(exchanges.model_dump(mode="json"))
    if not found:  # only answers without a choice
        return dumped
    main, *more = found
    return {**dumped, **main, "additional_histories": more}


def _no_local_backend_without_torch() -> None:
    """Make `from art.local.backend import LocalBackend` work where torch is not installed, with a
    LocalBackend nothing is an instance of (constructing one says why it cannot be)."""
    if "art.local.backend" in sys.modules or importlib.util.find_spec("torch") is not None:
        return

    class LocalBackend:
        def __init__(self, *args: Any, **kwargs: Any):
            raise ImportError("ART's LocalBackend needs torch, which this environment does not have; "
                              "use client.adapters.art_compat.ArtisanBackend to train on an art-server")

    module = types.ModuleType("art.local.backend", "Stand-in: ART's LocalBackend needs torch (client/adapters/art_compat.py).")
    module.LocalBackend = LocalBackend
    sys.modules["art.local.backend"] = module


_no_local_backend_without_torch()

# run name -> the step this task's rollouts sample from, inside an adapter lease
_PINNED: contextvars.ContextVar[dict[str, int]] = contextvars.ContextVar("artisan_pinned_steps", default={})


class ArtisanBackend(art.Backend):
    def __init__(self, base_url: str, api_key: str | None = None):
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self._runs: dict[str, TrainableModel] = {}
        self._leases: dict[str, Counter[int]] = {}  # run -> step -> leases held

    def _run(self, model: Any) -> TrainableModel:
        if model.name not in self._runs:
            raise RuntimeError(f"model {model.name!r} is not registered with this backend")
        return self._runs[model.name]

    async def register(self, model: Any) -> None:
        if not getattr(model, "trainable", False):  # a judge or baseline: served elsewhere, nothing to make here
            return
        run = TrainableModel(model.name, project=model.project, base_model=getattr(model, "base_model", None))
        self._runs[model.name] = await run.register(self.base_url, self.api_key)

    async def _prepare_backend_for_training(self, model: Any, config: Any = None) -> tuple[str, str]:
        return self.base_url + "/v1", self.api_key or "EMPTY"

    def _model_inference_name(self, model: Any, step: int | None = None) -> str:
        step = _PINNED.get().get(model.name) if step is None else step
        return model.name if step is None else policy_name(model.name, step)

    # ---- ART's PipelineTrainer hooks -------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def adapter_retention_lease(self, model: Any, step: int) -> AsyncIterator[None]:
        """Step `step`'s adapter stays loaded while the lease is held: prune_model_adapters keeps it."""
        leases = self._leases.setdefault(model.name, Counter())
        leases[step] += 1
        try:
            yield
        finally:
            leases[step] -= 1
            if leases[step] <= 0:
                del leases[step]

    @contextlib.asynccontextmanager
    async def adapter_lease(self, model: Any, step: int) -> AsyncIterator[None]:
        """A rollout inside the lease samples from step `step` (`name@step`), whatever has been
        trained meanwhile, and that step's adapter stays loaded."""
        token = _PINNED.set({**_PINNED.get(), model.name: step})
        try:
            async with self.adapter_retention_lease(model, step):
                yield
        finally:
            _PINNED.reset(token)

    def exact_adapter_lease(self, model: Any, step: int) -> contextlib.AbstractAsyncContextManager[None]:
        """`name@step` is that step's exact adapter on art-server: the same lease."""
        return self.adapter_lease(model, step)

    async def prune_model_adapters(self, model: Any, *, retain_steps: set[int]) -> None:
        """Unload every adapter of the run on the server but `retain_steps` and the leased ones;
        an unloaded step is still served from its checkpoint if asked for."""
        leased = set(self._leases.get(model.name, ()))
        await self._run(model).retain_adapters(set(retain_steps) | leased)

    async def _get_step(self, model: Any) -> int:
        return await self._run(model).get_step()

    async def train(self, model: Any, trajectory_groups: Iterable[Any], **kwargs: Any) -> art.TrainResult:
        """One RL step. A step with nothing to train raises with its warnings: ART loops that wait
        for the step to advance would otherwise wait for ever."""
        run = self._run(model)
        result = await run.train(_groups(trajectory_groups), train_config(**kwargs))
        if not result.trained:
            raise ServerError(f"nothing was trained at step {result.step}: " + " ".join(result.warnings))
        return art.TrainResult(step=result.step, metrics=_numbers(result.metrics.model_dump()))

    async def _train_sft(self, model: Any, trajectories: Iterable[Any], config: Any, dev_config: Any,
                         verbose: bool = False) -> AsyncIterator[dict[str, float]]:
        lr = getattr(config, "learning_rate", None)
        if isinstance(lr, list):
            raise UnsupportedArgument("learning_rate: a schedule (a list) is not supported; give one number")
        batch = getattr(config, "batch_size", "auto")
        cfg = SFTConfig(learning_rate=lr, **({} if batch == "auto" else {"batch_size": batch}))
        convs = [Conversation(messages=t.messages(), tools=t.tools) for t in trajectories]
        result = await self._run(model).train_sft(convs, cfg)
        yield _numbers(result.metrics.model_dump())

    async def _delete_checkpoint_files(self, model: Any, steps_to_keep: list[int]) -> None:
        run = self._run(model)
        step = await run.get_step()
        for c in await run.list_checkpoints():
            if c["step"] not in steps_to_keep and c["step"] != step:
                await run.request("DELETE", f"/v1/runs/{run.name}/checkpoints/{c['step']}")

    async def close(self) -> None:
        self._runs.clear()


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
