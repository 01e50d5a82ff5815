"""OpenAI wire schemas: one per endpoint, shared by the gateway and the worker.

The gateway validates a request once against its endpoint's schema, before it is queued;
the worker validates it again with the same classes, so both apply the same rules and a
client talking to a worker directly meets them too.

Invariants of every schema:

- Strict types, as JSON has them: a boolean is ``true``/``false`` (never ``1`` or
  ``"yes"``), an integer is a number without a fraction (``5`` or ``5.0``, as JSON Schema
  counts them; never ``true``, ``"5"`` or ``5.5``), a string is a string.
- Every number, list and identifier is bounded (the ``MAX_*`` constants below), so nothing
  that passes validation can make the scheduler's arithmetic or the engines fail; what
  depends on the model (its context, its output limit, its dimensions) is the worker's to
  check, with a 400 or 413 that names the field.
- Unknown fields are accepted and ignored, as OpenAI-compatible servers do; the gateway
  forwards them untouched to upstreams that may use them.

Validation errors become 400s that name the field (``validation_error``); the message is
pydantic's description of the rule, never Python exception text.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from tidegate.errors import InvalidRequest

MAX_NAME_CHARS = 256  # model, user: identifiers, not text
MAX_LEVEL_CHARS = 64  # a priority level's name
MAX_INPUTS = 2048  # embeddings inputs per request (OpenAI's limit)
MAX_TOKEN_IDS = 65_536  # token ids in one embeddings input
MAX_TOKEN_ID = 2**31 - 1
MAX_MESSAGES = 4096  # chat messages per request
MAX_CONTENT_PARTS = 256  # parts of one chat message
MAX_STOP_SEQUENCES = 4  # as OpenAI
MAX_STOP_CHARS = 1024  # one stop sequence
MAX_OUTPUT_TOKENS = 2**20  # max_tokens; a model's own limit is lower and checked by the worker
MAX_DIMENSIONS = 65_536
INT64 = 2**63  # seed is a signed 64-bit integer

_WireT = TypeVar("_WireT", bound="_Wire")


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def _integral(value: Any) -> Any:
    """JSON has one kind of number: ``5.0`` is the integer 5 (JSON Schema agrees)."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


def _integral_items(value: Any) -> Any:
    if type(value) is list and any(type(item) is float for item in value):
        return [_integral(item) for item in value]
    return value


ModelName = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
User = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
# Bounds before the validator, or they leave the JSON schema as unknown keywords.
OutputTokens = Annotated[int, Field(ge=1, le=MAX_OUTPUT_TOKENS), BeforeValidator(_integral)]
TokenIds = Annotated[
    list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]],
    Field(min_length=1, max_length=MAX_TOKEN_IDS),
    BeforeValidator(_integral_items),  # once per list: a function call per id is slow
]
Text = Annotated[str, Field(min_length=1)]
Priority = (
    Annotated[int, Field(ge=0, le=255), BeforeValidator(_integral)]
    | Annotated[str, Field(max_length=MAX_LEVEL_CHARS)]
)


class _Routed(_Wire):
    """Fields of every endpoint: which model, and (gateway only) at which priority."""

    model: ModelName
    user: User | None = None
    priority: Priority | None = Field(
        default=None,
        description="tidegate: a priority level's name or index (0 is the most urgent); the "
        "X-Priority header wins over it. Never above the API key's cap (403). Read by the "
        "gateway, not forwarded.",
    )


class EmbeddingsRequest(_Routed):
    input: Annotated[
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)],
        Field(description="Text, a list of texts, or token ids; never empty."),
    ]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: (
        Annotated[int, Field(ge=1, le=MAX_DIMENSIONS), BeforeValidator(_integral)] | None
    ) = None


class StreamOptions(_Wire):
    include_usage: bool = False


StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class _Sampling(_Routed):
    max_tokens: OutputTokens | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: Annotated[int, Field(ge=-INT64, lt=INT64), BeforeValidator(_integral)] | None = None
    n: Annotated[int, Field(ge=1, le=1), BeforeValidator(_integral)] = Field(
        default=1, description="Only 1 is supported."
    )
    stream: bool = False
    stream_options: StreamOptions | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] = Field(
        description="One prompt: a string, or a list holding exactly one string."
    )
    echo: bool = False

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ContentPart(_Wire):
    type: Literal["text"]
    text: str


class ChatMessage(_Wire):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: OutputTokens | None = None

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


EndpointRequest = EmbeddingsRequest | CompletionRequest | ChatCompletionRequest
REQUEST_OF_PATH: dict[str, type[EndpointRequest]] = {
    "/v1/embeddings": EmbeddingsRequest,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}


# ----------------------------------------------------------------- upstream models
# A model served by vLLM, SGLang or TGI (`engine: openai`) takes more of the OpenAI API than
# tidegate's own engines: several choices, image or audio parts, batched or token-id
# prompts, tool messages. The gateway checks what it reads itself just as strictly (model,
# priority, stream, output tokens: the queue's token budget) and leaves the rest to the
# server, which answers its own 400s.
MAX_CHOICES = 128  # n


class UpstreamContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
    text: str | None = None


class UpstreamChatMessage(ChatMessage):
    role: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]  # type: ignore[assignment]
    content: (
        str | Annotated[list[UpstreamContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None
    ) = None  # type: ignore[assignment]

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text or "" for part in self.content)


Choices = Annotated[int, Field(ge=1, le=MAX_CHOICES), BeforeValidator(_integral)]


class UpstreamCompletionRequest(CompletionRequest):
    prompt: (  # type: ignore[assignment]
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]
    )
    n: Choices = 1

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        # Token ids count as four characters each, as the embeddings' estimate does.
        return "".join(p if isinstance(p, str) else "    " * _num_ids(p) for p in self.prompt)


class UpstreamChatCompletionRequest(ChatCompletionRequest):
    messages: Annotated[  # type: ignore[assignment]
        list[UpstreamChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)
    ]
    n: Choices = 1


def _num_ids(item: int | list[int]) -> int:
    return len(item) if isinstance(item, list) else 1


UPSTREAM_REQUEST_OF_PATH: dict[str, type[EndpointRequest]] = {
    "/v1/embeddings": EmbeddingsRequest,
    "/v1/completions": UpstreamCompletionRequest,
    "/v1/chat/completions": UpstreamChatCompletionRequest,
}


# ----------------------------------------------------------------- responses (for the docs)
# What a client gets back, described for the OpenAPI document; the worker builds these
# bodies itself, and an upstream may add fields of its own.
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """The body of every error: OpenAI's shape."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int | None = None  # absent for embeddings
    total_tokens: int


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="Floats, or base64 of float32s.")


class EmbeddingsResponse(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


RESPONSE_OF_PATH: dict[str, type[BaseModel]] = {
    "/v1/embeddings": EmbeddingsResponse,
    "/v1/completions": CompletionResponse,
    "/v1/chat/completions": ChatCompletionResponse,
}


def validation_error(exc: ValidationError) -> InvalidRequest:
    """The most telling problem of a pydantic error, as a 400 that names the field.

    A value that matches no member of a union gets one error per member; the member that
    got furthest (a broken rule rather than a wrong type, then the longest location) is the
    one the client meant. ``param`` is the field the client set; the message has the path.
    """
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    first = max(errors, key=lambda e: (not e["type"].endswith("_type"), len(e["loc"])))
    # pydantic names the union member it tried ("str", "list[str]"): not a field.
    path = [str(part) for part in first["loc"] if not _is_type_tag(part)]
    field_path: list[str] = []
    for part in first["loc"]:
        if _is_type_tag(part):
            break
        field_path.append(str(part))
    location = ".".join(path)
    return InvalidRequest(
        f"{location or 'body'}: {first['msg']}", param=".".join(field_path) or None
    )


def _is_type_tag(part: str | int) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def parse(model: type[_WireT], payload: Any) -> _WireT:
    """Validate a decoded JSON body; a 400 naming the field on failure."""
    if not isinstance(payload, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise validation_error(exc) from None
