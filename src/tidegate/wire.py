"""OpenAI wire schemas shared by the worker and the gateway.

Only the fields the scheduler and the engines need are typed; unknown fields are accepted
and ignored, as OpenAI-compatible servers do. Validation errors become 400s that name the
field (see ``validation_error``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tidegate.errors import InvalidRequest


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", str_strip_whitespace=False)


_WireT = TypeVar("_WireT", bound=_Wire)


class StreamOptions(_Wire):
    include_usage: bool = False


class EmbeddingsRequest(_Wire):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if value == "" or value == []:
            raise ValueError("input must not be empty")
        if isinstance(value, list) and any(item == "" or item == [] for item in value):
            raise ValueError("input must not contain empty items")
        return value


class _Sampling(_Wire):
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    stop: str | list[str] | None = None
    seed: int | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("exactly one prompt per request is supported")
        return value

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ContentPart(_Wire):
    type: Literal["text"]
    text: str


class ChatMessage(_Wire):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def validation_error(exc: ValidationError) -> InvalidRequest:
    """The first problem of a pydantic error, as a 400 that names the field."""
    first = exc.errors()[0]
    parts: list[str] = []
    for part in first["loc"]:
        # pydantic names the union member it tried ("str", "list[str]"): not a field.
        if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part):
            break
        parts.append(str(part))
    location = ".".join(parts)
    return InvalidRequest(f"{location or 'body'}: {first['msg']}", param=location or None)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def parse(model: type[_WireT], payload: Any) -> _WireT:
    """Validate a decoded JSON body; a 400 naming the field on failure."""
    if not isinstance(payload, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise validation_error(exc) from None
