"""Request schemas and response builders of the OpenAI-compatible API (`/v1/completions`,
`/v1/chat/completions`), with vLLM's extensions `top_k`, `ignore_eos`, `min_tokens`, `stop_token_ids`, `priority`.

Requests are validated strictly (no "5" for 5, no true for 1, no NaN); fields of the OpenAI API that the engine
does not implement are refused when set to a non-default value, unknown fields are ignored.
Responses are built as plain dicts (cheap to serialize once per token).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.prompt import Prompt
from engine.sampling_params import SamplingParams

__all__ = [
    "CHAT_COMPLETIONS",
    "COMPLETIONS",
    "SSE_DONE",
    "ChatCompletionRequest",
    "CompletionRequest",
    "Endpoint",
    "ResponseMeta",
    "ValidationError",
    "error_body",
    "format_validation_error",
    "sse_event",
]

INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1
SAMPLING_EPS = 1e-5
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _SamplingFields(_Strict):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=UINT64_MAX)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    logprobs: Any = None
    user: str | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> _SamplingFields:
        if self.n not in (None, 1):
            raise ValueError("only n=1 is supported")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ValueError(f"{name} is not supported (only 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return self

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        """`usage` closes every stream unless the client opts out with stream_options.include_usage=false."""
        return not (self.stream_options is not None and self.stream_options.include_usage is False)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self) -> SamplingParams:
        """Raises ValueError with the reason for a bad combination. max_tokens None becomes a placeholder that
        the engine loop replaces with what the context leaves."""
        max_tokens = self.requested_max_tokens()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        temperature = 1.0 if self.temperature is None else self.temperature
        top_p = 1.0 if self.top_p is None else self.top_p
        # Values the float32 sampler cannot represent would fail the whole batch's step (NaN probabilities):
        # a temperature below 1e-5 is greedy (as in vLLM); a top_p below 1e-6 keeps only the top token anyway.
        if 0.0 <= temperature < SAMPLING_EPS:
            temperature = 0.0
        if 0.0 < top_p < 1e-6:
            top_p = 1e-6
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else max(1, self.min_tokens),
            temperature=temperature,
            top_p=top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed, stop=stop, stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens)


class CompletionRequest(_SamplingFields):
    prompt: str | list[TokenId] | list[str | list[TokenId]]  # one prompt, or a batch of texts / token lists
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's default for completions
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(self.prompt, list) and any(isinstance(p, list) and not p for p in self.prompt):
            raise ValueError("prompt must not contain an empty token list")
        return self

    def prompts(self) -> list[Prompt]:
        p = self.prompt
        if isinstance(p, str):
            return [Prompt(text=p)]
        if all(isinstance(x, int) for x in p):
            return [Prompt(token_ids=[x for x in p if isinstance(x, int)])]
        return [Prompt(text=x) if isinstance(x, str) else Prompt(token_ids=list(x))
                for x in p if not isinstance(x, int)]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        if isinstance(self.content, list):
            content = "\n".join(part.text for part in self.content)
        else:
            content = self.content or ""
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: Any = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.tools:
            raise ValueError("tools are not supported")
        if self.response_format not in (None, {"type": "text"}):
            raise ValueError("response_format is not supported")
        if self.top_logprobs:
            raise ValueError("logprobs are not supported")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def prompts(self) -> list[Prompt]:
        return [Prompt(messages=[m.as_template_message() for m in self.messages])]


# Errors -------------------------------------------------------------------------------------------------------
def error_body(message: str, error_type: str = "invalid_request_error", param: str | None = None,
               code: int | str | None = None, **extra: Any) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code, **extra}}


def format_validation_error(error: ValidationError) -> tuple[str, str | None]:
    """A readable one-line reason and the offending field."""
    parts = []
    param = None
    for item in error.errors(include_url=False)[:5]:
        loc = ".".join(str(x) for x in item.get("loc", ()))
        param = param or (str(item["loc"][0]) if item.get("loc") else None)
        parts.append(f"{loc}: {item.get('msg')}" if loc else str(item.get("msg")))
    return "; ".join(parts) or str(error), param


# Responses ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResponseMeta:
    """What every response and chunk of one request repeats."""

    request_id: str
    created: int
    model: str


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + _dumps(payload).encode("utf-8") + b"\n\n"


def completion_chunk(meta: ResponseMeta, index: int, text: str, finish_reason: str | None,
                     first: bool) -> dict[str, Any]:
    return {"id": meta.request_id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_chunk(meta: ResponseMeta, index: int, text: str, finish_reason: str | None, first: bool) -> dict[str, Any]:
    delta = {"role": "assistant", "content": text} if first else {"content": text}
    return {"id": meta.request_id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(meta: ResponseMeta, obj: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"id": meta.request_id, "object": obj, "created": meta.created, "model": meta.model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def completion_response(meta: ResponseMeta, texts: list[str], finish_reasons: list[str | None], prompt_tokens: int,
                        completion_tokens: int) -> dict[str, Any]:
    return {"id": meta.request_id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
                        for i, (t, r) in enumerate(zip(texts, finish_reasons))],
            "usage": usage(prompt_tokens, completion_tokens)}


def chat_response(meta: ResponseMeta, texts: list[str], finish_reasons: list[str | None], prompt_tokens: int,
                  completion_tokens: int) -> dict[str, Any]:
    """A chat request has one prompt, so one choice."""
    return {"id": meta.request_id, "object": "chat.completion", "created": meta.created, "model": meta.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": texts[0]}, "logprobs": None,
                         "finish_reason": finish_reasons[0]}],
            "usage": usage(prompt_tokens, completion_tokens)}


@dataclass(frozen=True)
class Endpoint:
    """What differs between /v1/completions and /v1/chat/completions; everything else is one path."""

    request_model: type[CompletionRequest | ChatCompletionRequest]
    id_prefix: str
    chunk_object: str
    chunk: Callable[[ResponseMeta, int, str, str | None, bool], dict[str, Any]]
    response: Callable[[ResponseMeta, list[str], list[str | None], int, int], dict[str, Any]]


COMPLETIONS = Endpoint(CompletionRequest, "cmpl", "text_completion", completion_chunk, completion_response)
CHAT_COMPLETIONS = Endpoint(ChatCompletionRequest, "chatcmpl", "chat.completion.chunk", chat_chunk, chat_response)
