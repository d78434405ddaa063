"""Typed request models for the OpenAI-compatible routes.

The published schema states what the handlers enforce: message roles and shapes, tool specs,
every numeric bound. Message order (tool results after their call) is checked by
server/chat/validate.py, which names the offending message.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator,
                      model_validator)

from protocol.choices import INT64
from protocol.nesting import check_message_calls
from server.chat.tool_calls import ToolSchemas, tool_schemas
from server.request_errors import ParamError

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_N = 64
MAX_STOPS = 4

_TEXT = {"anyOf": [{"type": "string"}, {"type": "array", "items": {
    "type": "object", "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}
_TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "arguments": {"anyOf": [{"type": "string"}, {"type": "object"}]}}}}}
MESSAGES_SCHEMA = {"type": "array", "minItems": 1, "items": {"oneOf": [
    {"type": "object", "required": ["role", "content"],
     "properties": {"role": {"enum": ["system", "developer", "user"]}, "content": _TEXT, "name": {"type": "string"}}},
    {"type": "object", "required": ["role"], "properties": {
        "role": {"const": "assistant"}, "content": {"anyOf": [_TEXT, {"type": "null"}]},
        "reasoning_content": {"type": "string"}, "tool_calls": {"type": "array", "items": _TOOL_CALL},
        "token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}}}},
    {"type": "object", "required": ["role", "tool_call_id", "content"], "properties": {
        "role": {"const": "tool"}, "tool_call_id": {"type": "string"}, "content": _TEXT}},
]}}


def object_schema(v: dict[str, Any], field: str) -> dict[str, Any]:
    """A tool's arguments schema, as far as templates and constrained decoding need it."""
    if v.get("type", "object") != "object":
        raise ValueError(f"{field} must be a JSON Schema with type 'object'")
    props = v.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(p, dict) for p in props.values()):
        raise ValueError(f"{field}.properties must map names to JSON Schemas")
    if not isinstance(v.get("required", []), list):
        raise ValueError(f"{field}.required must be a list")
    return v



# The values of vLLM's and OpenAI's sampling knobs that leave the distribution as it is. art-server
# samples with temperature and top_p only; any other value is refused, naming the field, not
# ignored: a choice whose logprobs are not of the distribution it was drawn from would train wrong.
NEUTRAL = {"top_k": (-1, 0), "min_p": (0.0,), "repetition_penalty": (1.0,), "presence_penalty": (0.0,),
           "frequency_penalty": (0.0,)}


class NeutralKnobs(BaseModel):
    """The knobs of NEUTRAL, as the chat and generate routes take them."""

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @field_validator(*NEUTRAL)
    @classmethod
    def _neutral(cls, v: float | None, info: ValidationInfo) -> float | None:
        allowed = NEUTRAL[info.field_name]
        if v is not None and v not in allowed:
            raise ValueError(f"art-server samples with temperature and top_p only; {info.field_name} must be "
                             f"{' or '.join(map(str, allowed))} (or absent)")
        return v


def stop_list(v: str | list[str] | None) -> list[str]:
    """`stop` as every route takes it: one string or up to MAX_STOPS, empty ones dropped."""
    stops = [] if v is None else [v] if isinstance(v, str) else v
    if len(stops) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop sequences")
    return [s for s in stops if s]


def no_logit_bias(v: dict[str, float] | None) -> dict[str, float] | None:
    # Refused, not ignored, for the reason NEUTRAL gives.
    if v and any(v.values()):
        raise ValueError("logit_bias is not supported: the trainer cannot reproduce a biased distribution")
    return v


def refused(kind: Any, why: str, neutral: tuple[Any, ...] = ()) -> Any:
    """A field of `kind` named in the schema and refused, with `why`, whenever it is set to other than
    a `neutral` value (one that changes nothing): what the server cannot honour is a 400 naming it,
    never silently dropped."""
    def refuse(v: Any) -> Any:
        if v is not None and v not in neutral:
            raise ValueError(why)
        return v
    return Annotated[kind, AfterValidator(refuse), Field(description=f"not supported: {why}")]


def own_tools_only(tools: Any, own: tuple[str | None, ...]) -> Any:
    """A request's tools as sent, unless one is of a type the API's provider runs itself (web search,
    code execution, MCP): no model here calls those, and a client would wait on their results."""
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        if isinstance(tool, dict) and tool.get("type") not in own:
            raise ValueError(f"tools[{i}] is a hosted tool ({tool.get('type')!r}), which art-server does not run: "
                             f"give the model a function tool of your own")
    return tools


# `stop` as a list however it was sent, and logit_bias as every route refuses it.
Stops = Annotated[Union[str, list[str], None], AfterValidator(stop_list)]
LogitBias = Annotated[dict[str, float] | None, AfterValidator(no_logit_bias)]

# `top_k` as the Responses and Messages faces take it: the trainer could not reproduce the distribution.
RefusedTopK = refused(int | None, "top_k is not supported: the trainer cannot reproduce top-k sampling")


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=TOOL_NAME.pattern)
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if v is None else object_schema(v, "parameters")


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str = Field(pattern=TOOL_NAME.pattern)


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str = Field(default="response", max_length=64)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _needs_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema")
        return self


Messages = Annotated[list[dict[str, Any]], WithJsonSchema(MESSAGES_SCHEMA)]
ToolChoice = Annotated[Any, WithJsonSchema({"anyOf": [
    {"enum": ["auto", "none", "required"]},
    {"type": "object", "required": ["function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": TOOL_NAME.pattern}}}}},
    {"type": "null"}]})]


# vLLM's keys for prefilling a reply: every prompt here ends on a new assistant turn's generation prompt.
ContinueFinalMessage = refused(bool | None, "continue_final_message is not supported: art-server renders messages "
                               "as a prompt for a new assistant turn", (False,))
AddGenerationPrompt = refused(bool | None, "add_generation_prompt false is not supported: art-server renders "
                              "messages as a prompt for a new assistant turn", (True,))


class StructuredOutputs(BaseModel):
    """vLLM's structured outputs: the output must match exactly one of a JSON Schema, a regular
    expression, a list of choices or a lark grammar (server/engine/constraints.py compiles it)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)  # disable_fallback, whitespace_pattern: hints
    json_schema: dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, max_length=10_000)
    choice: list[str] | None = Field(default=None, min_length=1, max_length=1_000)
    grammar: str | None = Field(default=None, max_length=100_000)
    json_object: bool | None = None
    structural_tag: refused(Any, "structured_outputs.structural_tag is not supported: give the functions in "
                            "tools and force a call with tool_choice") = None

    @field_validator("json_schema", mode="before")
    @classmethod
    def _schema(cls, v: Any) -> Any:
        if isinstance(v, str):  # vLLM takes the schema as a dict or as its JSON text
            try:
                v = json.loads(v)
            except ValueError:
                raise ValueError("structured_outputs.json must be a JSON Schema (a dict, or its JSON text)")
        return v

    @model_validator(mode="after")
    def _one(self) -> "StructuredOutputs":
        given = [name for name, value in (("json", self.json_schema), ("regex", self.regex), ("choice", self.choice),
                                          ("grammar", self.grammar), ("json_object", self.json_object))
                 if value not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of json, regex, choice, grammar and json_object "
                             f"(got {', '.join(given) or 'none'})")
        return self


# vLLM's older names for structured outputs, still sent by its clients.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class VLLMSampling(NeutralKnobs):
    """vLLM's own sampling keys, as its OpenAI routes and its token-in route take them: structured
    outputs honoured (`structured_outputs`, or the `guided_*` keys), and the keys that would change
    what is sampled or returned refused at any value but their default, for NEUTRAL's reason or
    because the client would not get what it asked for."""

    structured_outputs: StructuredOutputs | None = None
    min_tokens: refused(int | None, "min_tokens is not supported: holding back the end of the turn samples from "
                        "a distribution the trainer cannot reproduce", (0,)) = None
    use_beam_search: refused(bool | None, "use_beam_search is not supported: art-server samples", (False,)) = None
    include_stop_str_in_output: refused(bool | None, "include_stop_str_in_output is not supported: the text ends "
                                        "where a stop string begins (token_ids hold every sampled token)",
                                        (False,)) = None
    truncate_prompt_tokens: refused(int | None, "truncate_prompt_tokens is not supported: art-server never "
                                    "truncates a prompt; send a shorter one") = None
    allowed_token_ids: refused(list[int] | None, "allowed_token_ids is not supported: the trainer cannot "
                               "reproduce a masked distribution; constrain with structured_outputs") = None
    bad_words: refused(list[str] | None, "bad_words is not supported: the trainer cannot reproduce a masked "
                       "distribution", ([],)) = None
    logits_processors: refused(list[Any] | None, "logits_processors is not supported: the trainer cannot "
                               "reproduce a processed distribution", ([],)) = None
    prompt_logprobs: refused(int | None, "prompt_logprobs is not supported here: score a prompt with POST "
                             "/v1/completions (echo and logprobs) or POST /v1/logprobs") = None

    @model_validator(mode="before")
    @classmethod
    def _guided(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not any(data.get(k) is not None for k in GUIDED):
            return data
        if data.get("structured_outputs") is not None:
            raise ParamError("structured_outputs", "give structured_outputs or vLLM's older guided_* keys, not both")
        guided = {GUIDED[k]: data[k] for k in GUIDED if data.get(k) is not None}
        return {**{k: v for k, v in data.items() if k not in GUIDED}, "structured_outputs": guided}


class OpenAISampling(VLLMSampling):
    """How OpenAI's chat and text completions both sample, bounded alike. Unknown parameters (user,
    metadata, store, ...) are accepted and ignored; those that would change the distribution sampled
    from are refused unless neutral (NEUTRAL, logit_bias)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(max_length=300)
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float = Field(default=1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    stop: Stops = Field(default=None, validate_default=True)
    seed: int | None = Field(default=None, ge=-(2**63), le=INT64)  # OpenAI's int64
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logit_bias: LogitBias = None
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name each token "token_id:<id>"


class ChatCompletionRequest(OpenAISampling):
    messages: Messages = Field(min_length=1)
    tools: list[ToolSpec] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool = True  # False: at most one call (honoured when tool_choice forces a call)
    response_format: ResponseFormat | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT64)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens (benchmarks)
    # OpenAI's that no model here could honour: ignored, the model would never see the functions.
    functions: refused(list[Any] | None, "functions is OpenAI's deprecated form of tools: send "
                       "tools=[{\"type\": \"function\", \"function\": {...}}]") = None
    function_call: refused(Any, "function_call is OpenAI's deprecated form of tool_choice: send tool_choice") = None
    web_search_options: refused(dict[str, Any] | None, "art-server runs no hosted web search: give the model a "
                                "search tool of your own") = None
    audio: refused(dict[str, Any] | None, "art-server samples text only") = None
    modalities: list[Literal["text"]] | None = None  # text only
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension (e.g. enable_thinking)
    # Reaches the model as its template reads it (gpt-oss's system message), as vLLM passes it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    continue_final_message: ContinueFinalMessage = None
    add_generation_prompt: AddGenerationPrompt = None
    echo: refused(bool | None, "echo is not supported on chat completions: the messages are yours already",
                  (False,)) = None

    @field_validator("messages")
    @classmethod
    def _calls_within_bounds(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # Parsed once here, so that arguments no template or turn key could read are a 400 naming them.
        for i, m in enumerate(messages):
            check_message_calls(m, f"messages[{i}]")
        return messages

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> str | NamedToolChoice | None:
        if v is None or v in ("auto", "none", "required"):
            return v
        if isinstance(v, dict):
            return NamedToolChoice.model_validate(v)
        raise ValueError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}")

    @model_validator(mode="after")
    def _check(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs: true")
        named = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        if named is not None and named not in {t.function.name for t in self.tools or []}:
            raise ParamError("tool_choice", f"tool_choice names {named!r}, which is not among the tools")
        if self.tool_choice == "required" and not self.tools:
            raise ParamError("tool_choice", "tool_choice 'required' needs tools")
        constrained = (self.tool_choice == "required" or named is not None
                       or (self.response_format is not None and self.response_format.type != "text"))
        if self.structured_outputs is not None and constrained:
            raise ParamError("structured_outputs", "structured_outputs cannot be combined with response_format "
                                                   "or a forced tool call: give one constraint")
        if self.reasoning_effort is not None:  # chat_template_kwargs, where it names one, wins
            self.chat_template_kwargs = {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}
        return self

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def callable_tools(self) -> ToolSchemas | None:
        """The tools the model may call, as the output parser reads them; None when it may call none."""
        return tool_schemas(self.tool_dicts()) if self.tools and self.tool_choice != "none" else None
