"""`POST /v1/logprobs`: the logprobs a served model gives to token ids it is shown (a teacher
scoring a student's exact tokens), with the top-k alternatives and the remaining mass."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_TOP_K = 20


class TokenSequence(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token_ids: list[int] = Field(min_length=2, max_length=2**20)
    # The first position scored: token_ids[start:] get logprobs, each given the tokens before it
    # (1: all but the first, which nothing predicts).
    start: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _inside(self) -> "TokenSequence":
        if self.start >= len(self.token_ids):
            raise ValueError(f"start {self.start} leaves nothing to score in {len(self.token_ids)} tokens")
        if any(t < 0 for t in self.token_ids):
            raise ValueError("token ids are not negative")
        return self


class LogprobsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=200, description="the base model, a run, or run@step")
    sequences: list[TokenSequence] = Field(min_length=1, max_length=4096)
    top_k: int = Field(default=0, ge=0, le=MAX_TOP_K)


class SequenceLogprobs(BaseModel):
    logprobs: list[float]  # of token_ids[start:]
    top: list[list[tuple[int, float]]] | None = None  # per position: the k likeliest (token id, logprob)
    rest: list[float] | None = None  # per position: log of the probability outside the top k (floored at -1e4)


class LogprobsResponse(BaseModel):
    model: str
    data: list[SequenceLogprobs]
