"""Typed requests of Anthropic's Messages API, as far as art-server serves it.

Content blocks are text, `tool_use`, `tool_result` and `thinking` (what a harness echoes back of
earlier turns); images, documents and server tools fail validation with the block's place named.
Unknown top-level parameters (metadata, service_tier, ...) are accepted and ignored; `thinking` is
checked as Anthropic defines it (the chat template, not it, decides whether the model thinks);
`output_config.format` (structured outputs) constrains the answer as chat's `response_format` does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from protocol.choices import INT64
from protocol.nesting import check_arguments
from server.request_errors import ParamError
from server.sampling.chat_request import (MAX_STOPS, TOOL_NAME, RefusedTopK, ResponseFormat, object_schema,
                                         own_tools_only, refused)


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations: nothing a template renders


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=200)
    name: str = Field(pattern=TOOL_NAME.pattern)
    input: dict[str, Any]

    @field_validator("input")
    @classmethod
    def _within_bounds(cls, v: dict[str, Any]) -> dict[str, Any]:
        check_arguments(v, "input")
        return v


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=200)
    content: Union[str, list[TextBlock]] = ""
    is_error: bool = False


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock], Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: Union[str, Annotated[list[Block], Field(max_length=100_000)]]


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["custom"] | None = None
    name: str = Field(pattern=TOOL_NAME.pattern)
    description: str | None = None
    input_schema: dict[str, Any]

    @field_validator("input_schema")
    @classmethod
    def _schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        return object_schema(v, "input_schema")


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, pattern=TOOL_NAME.pattern)
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> "ToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice of type 'tool' needs a name, and only it takes one")
        return self


class Thinking(BaseModel):
    """Anthropic's thinking configuration: the types its SDK documents, and a manual budget of at
    least 1024 tokens (that it is under `max_tokens` is checked where the request becomes a chat
    request, server/api/translate.py, so that the 400 names `thinking.budget_tokens`)."""
    model_config = ConfigDict(extra="ignore")  # display: how thinking is shown, which is the template's

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=1024, le=INT64, validate_default=True)

    @field_validator("budget_tokens")
    @classmethod
    def _budget(cls, v: int | None, info: ValidationInfo) -> int | None:
        if info.data.get("type") == "enabled" and v is None:
            raise ValueError("thinking of type 'enabled' needs budget_tokens")
        return v


class OutputFormat(BaseModel):
    """Anthropic's structured outputs: an answer of JSON that the schema admits."""
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")  # a newer hint than this server knows is not a sampling knob

    format: OutputFormat | None = None
    # How much the model should think: reaches the template as chat's reasoning_effort does.
    effort: Literal["low", "medium", "high", "max"] | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(max_length=300)
    max_tokens: int = Field(ge=1, le=INT64)
    messages: list[Message] = Field(min_length=1, max_length=100_000)
    system: Union[str, list[TextBlock], None] = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOPS)
    temperature: float = Field(default=1.0, ge=0, le=1, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: RefusedTopK = None
    thinking: Thinking | None = None
    stream: bool = False
    seed: int | None = Field(default=None, ge=-(2**63), le=INT64)  # artisan's: reproducible samples
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension (e.g. enable_thinking)
    mcp_servers: refused(list[Any] | None, "art-server connects to no MCP servers: give the model their tools "
                         "in tools, and run them yourself") = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's name for output_config.format

    @field_validator("tools", mode="before")
    @classmethod
    def _own_tools(cls, v: Any) -> Any:
        return own_tools_only(v, (None, "custom"))

    @model_validator(mode="after")
    def _check(self) -> "MessagesRequest":
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and choice.name not in {t.name for t in self.tools or []}:
            raise ParamError("tool_choice", f"tool_choice names {choice.name!r}, which is not among the tools")
        if choice is not None and choice.type == "any" and not self.tools:
            raise ParamError("tool_choice", "tool_choice 'any' needs tools")
        if self.output_format is not None and self.output_config is not None and self.output_config.format is not None:
            raise ParamError("output_format", "give the format in output_config.format or in output_format, not both")
        return self

    def response_format(self) -> ResponseFormat | None:
        """The chat `response_format` the structured-outputs format amounts to."""
        f = self.output_format or (self.output_config.format if self.output_config else None)
        return None if f is None else ResponseFormat.model_validate(
            {"type": "json_schema", "json_schema": {"name": "output", "schema": f.schema_}})

    def reasoning_effort(self) -> str | None:
        effort = self.output_config.effort if self.output_config else None
        return "xhigh" if effort == "max" else effort


class CountTokensRequest(MessagesRequest):
    """`POST /v1/messages/count_tokens`: a Messages request counted, not sampled, so without max_tokens."""

    max_tokens: int = Field(default=INT64, ge=1, le=INT64)  # no budget: nothing is sampled
