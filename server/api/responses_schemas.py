"""Typed requests of OpenAI's Responses API, as far as art-server serves it.

Input is a string or a list of items: messages (text parts only), `function_call`,
`function_call_output` and `reasoning` items, which is what a harness echoes back of earlier
responses. Item types and tool types that a chat template cannot render (images, files, hosted
tools) fail validation with the item's place named. Unknown top-level parameters are accepted and
ignored, as for chat; `top_k`, which a client may send meaning it, is refused, and `text.format`
constrains the answer as chat's `response_format` does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from openai.types.responses import ResponseIncludable
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from protocol.choices import INT64
from protocol.nesting import check_arguments
from server.request_errors import ParamError
from server.sampling.chat_request import (TOOL_NAME, FunctionSpec, RefusedTopK, ResponseFormat, own_tools_only,
                                          refused)


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")  # status, annotations: what clients echo back


class _InputItem(_Item):
    id: str | None = Field(default=None, max_length=200)  # an echoed item's, which input_items lists it by


class TextPart(_Item):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_InputItem):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[TextPart]]


class FunctionCallItem(_InputItem):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=200)
    name: str = Field(pattern=TOOL_NAME.pattern)
    arguments: str = Field(max_length=10_000_000)

    @field_validator("arguments")
    @classmethod
    def _within_bounds(cls, v: str) -> str:
        check_arguments(v, "arguments")
        return v


class FunctionCallOutputItem(_InputItem):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=200)
    output: Union[str, list[TextPart]]


class ReasoningText(_Item):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_InputItem):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None


def _item_type(item: Any) -> str | None:
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")],
                            Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]],
                      Discriminator(_item_type, custom_error_type="invalid_item",
                                    custom_error_message="item type must be message, function_call, "
                                                         "function_call_output or reasoning")]


class FunctionTool(FunctionSpec):
    type: Literal["function"]
    strict: bool | None = None


class NamedFunctionChoice(BaseModel):
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME.pattern)


class PlainFormat(BaseModel):
    type: Literal["text", "json_object"]


class JsonSchemaTextFormat(BaseModel):
    """Responses' flat form of chat's `{"type": "json_schema", "json_schema": {...}}`."""
    type: Literal["json_schema"]
    name: str = Field(default="response", max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")  # verbosity: a hint to OpenAI's models, nothing to sample by

    format: Annotated[Union[PlainFormat, JsonSchemaTextFormat], Field(discriminator="type")] = PlainFormat(type="text")

    def response_format(self) -> ResponseFormat:
        """The chat `response_format` this format amounts to."""
        f = self.format
        if isinstance(f, JsonSchemaTextFormat):
            return ResponseFormat.model_validate({"type": "json_schema", "json_schema": {
                "name": f.name, "schema": f.schema_, "strict": f.strict}})
        return ResponseFormat(type=f.type)


# `include` takes OpenAI's values, as the SDK defines them. Only the text's logprobs add anything here; the
# others name what art-server has none of (tool calls OpenAI runs, images, encrypted reasoning), and are
# accepted as Codex sends them.
TEXT_LOGPROBS = "message.output_text.logprobs"


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(max_length=300)
    input: Union[str, Annotated[list[InputItem], Field(min_length=1, max_length=100_000)]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Union[Literal["auto", "none", "required"], NamedFunctionChoice, None] = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT64)
    temperature: float = Field(default=1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: RefusedTopK = None
    text: TextConfig = Field(default_factory=TextConfig)
    previous_response_id: str | None = Field(default=None, max_length=200)
    store: bool = True
    stream: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[ResponseIncludable] | None = Field(default=None, max_length=16)
    seed: int | None = Field(default=None, ge=-(2**63), le=INT64)  # artisan's: reproducible samples
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension (e.g. enable_thinking)
    # OpenAI's state, which art-server does not keep: ignored, the model would not see what they hold.
    conversation: refused(Any, "art-server keeps no conversations: send the earlier items in input, or "
                          "previous_response_id") = None
    prompt: refused(Any, "art-server keeps no stored prompts: send the prompt's text in instructions") = None

    @field_validator("tools", mode="before")
    @classmethod
    def _own_tools(cls, v: Any) -> Any:
        return own_tools_only(v, ("function",))

    @field_validator("input")
    @classmethod
    def _some_input(cls, v: Any) -> Any:
        if isinstance(v, str) and not v:
            raise ValueError("input must not be empty")
        return v

    @property
    def text_logprobs(self) -> bool:
        return TEXT_LOGPROBS in (self.include or ())

    @model_validator(mode="after")
    def _check(self) -> "ResponsesRequest":
        if isinstance(self.tool_choice, NamedFunctionChoice) and \
                self.tool_choice.name not in {t.name for t in self.tools or []}:
            raise ParamError("tool_choice",
                             f"tool_choice names {self.tool_choice.name!r}, which is not among the tools")
        if self.tool_choice == "required" and not self.tools:
            raise ParamError("tool_choice", "tool_choice 'required' needs tools")
        return self
