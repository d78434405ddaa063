"""Which judge to call, and the figures and error a judgment leaves behind."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


JUDGMENT_FIGURES = ("judged", "failed", "skipped", "attempts", "malformed")


def judgment(**counts: int) -> dict[str, int]:
    """A group's judge figures (its metadata["ruler"]): each of JUDGMENT_FIGURES, 0 unless given."""
    return {name: counts.get(name, 0) for name in JUDGMENT_FIGURES}


class JudgeError(Exception):
    """The judge could not produce a valid verdict (unreachable, or invalid replies to the end)."""

    def __init__(self, message: str, *, attempts: int = 0, model: str = "", malformed: int = 0) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.model = model
        self.malformed = malformed  # of the attempts, replies that came back but were no valid verdict
        # What the gather keeps of the failed group (client/gather.py): the judge's figures, so a
        # step can count malformed replies of the judgments that failed too.
        self.group_metadata = {"ruler": judgment(failed=1, attempts=attempts, malformed=malformed)}


class JudgeConfig(BaseModel):
    """Which judge to call and how.

    backend "auto": an explicit ``base_url`` means an OpenAI-compatible endpoint (openai SDK);
    no ``base_url`` means a litellm model string. Use backend="litellm" with ``base_url`` to send a
    litellm model (e.g. "openai/judge") to a custom ``api_base``.
    """

    model_config = ConfigDict(extra="forbid")

    model: str
    base_url: str | None = None
    api_key: str | None = None
    backend: Literal["auto", "litellm", "openai"] = "auto"
    temperature: float | None = None  # None: the provider's default (some reasoning models refuse others)
    max_tokens: int | None = None
    timeout_s: float = Field(default=120.0, gt=0)
    # Ask for the reply's JSON schema as response_format (ids as an enum, scores in [0, 1]); an
    # endpoint that constrains decoding (art-server, vLLM) then cannot answer out of shape.
    # Switched off for the rest of a call if the endpoint refuses it with a 400.
    json_mode: bool = True
    extra: dict[str, Any] = Field(default_factory=dict)  # passed through to the completion call

    @classmethod
    def parse(cls, judge: "str | JudgeConfig") -> "JudgeConfig":
        if isinstance(judge, JudgeConfig):
            return judge
        if judge.startswith(("http://", "https://")):
            base_url, sep, model = judge.partition("#")
            if not sep or not model:
                raise ValueError(f"judge URL {judge!r} needs the model after '#', e.g. http://host:8000/v1#my-model")
            return cls(model=model, base_url=base_url, backend="openai")
        return cls(model=judge, backend="litellm")

    @property
    def uses_openai_sdk(self) -> bool:
        return self.backend == "openai" or (self.backend == "auto" and self.base_url is not None)
