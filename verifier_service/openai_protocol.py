"""The bodies of ``POST /v1/completions`` and ``POST /v1/chat/completions``, declared.

Each endpoint's model (pydantic, strict: a bool is not a number, "1" is not
an integer) lists every field of OpenAI's API for it, so nothing a client
sends can be dropped without a word:

* a field this server honours is declared with its type, and read by
  ``openai_api`` from the model (ranges and cross-field rules there and in
  the engine, which name the field too);
* a field it does not honour is declared as *refused*, with the value that
  changes nothing (its no-op): set to anything else it is a 400 with code
  ``unsupported_field`` that says why and what to send instead;
* any other key is a 400 with code ``unknown_field``.

``user``, ``metadata``, ``safety_identifier`` and the prompt-cache hints
(``prompt_cache_key``, chat's ``prompt_cache_retention`` and
``prompt_cache_options``) only label a request or tune a cache; they change
nothing in the answer, so any value is taken. The tests hold the models to
the ``openai`` package's own request types: every field it can send is
declared here. Every 400 names the field in ``param`` (``ApiError``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.responses import JSONResponse


class ApiError(Exception):
    """An answer in OpenAI's error shape (``openai_api`` renders it)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        # A message may quote the client's text: a lone surrogate in it could not be encoded.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code, self.headers = status, message, param, kind, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def raw(self) -> bytes:
        """The whole HTTP/1.1 response, closing the connection, for the protocol to write itself."""
        body = json.dumps(self.body()).encode()
        head = (
            f"HTTP/1.1 {self.status} {HTTPStatus(self.status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        return head.encode() + body


def shown(value: Any) -> str:
    """A short rendering of a client's value for an error message (a container by its kind:
    rendering one nested thousands deep would itself overflow the recursion limit)."""
    if isinstance(value, list | dict):
        return "a list" if isinstance(value, list) else "an object"
    return json.dumps(value)[:80]


@dataclass(frozen=True)
class Refusal:
    """A known field this server does not honour: refused unless ``no_op(value)``."""

    no_op: Callable[[Any], bool]
    no_op_shown: str  # the no-op, as the message shows it
    why: str


def _absent(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == []


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or (not isinstance(value, bool) and any(value == allowed for allowed in values))


# What a value of each kind must be, in the words of an error message (pydantic's error type -> words).
_KINDS = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "dict_type": "an object",
    "list_type": "a list",
}


class _Body(BaseModel):
    """The fields both endpoints take."""

    model_config = ConfigDict(extra="allow", strict=True)  # extra keys: refused by ``parse`` with its own message

    model: str | None = None
    max_tokens: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: Any = None  # a string or a list of strings, checked by openai_api
    stream: bool | None = None
    stream_options: dict | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict | None = None
    # Beyond OpenAI's (vLLM's names): honoured.
    top_k: int | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    num_speculative_tokens: int | None = None
    # Labels for the sender: any value, no effect.
    user: Any = None
    metadata: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    # Refused unless at their no-op (REFUSED says which and why).
    service_tier: Any = None
    store: Any = None

    ENDPOINT: ClassVar[str] = ""
    # A field whose type, in words, says more than its kind (the default is _KINDS').
    WHAT: ClassVar[dict[str, str]] = {
        "num_speculative_tokens": "an integer (unset: adaptive)",
        "logit_bias": "an object of token id -> bias",
    }
    REFUSED: ClassVar[dict[str, Refusal]] = {
        "service_tier": Refusal(_one_of("auto", "default"), '"auto"', "this server has one tier"),
        "store": Refusal(lambda value: value is None or value is False, "false", "this server stores no completions"),
    }


class ChatCompletionRequest(_Body):
    ENDPOINT: ClassVar[str] = "/v1/chat/completions"

    messages: Any = None  # a non-empty list of {role, content}, checked by openai_api
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    prompt_cache_retention: Any = None  # a cache hint: any value, no effect
    prompt_cache_options: Any = None  # the same

    REFUSED: ClassVar[dict[str, Refusal]] = _Body.REFUSED | {
        "response_format": Refusal(
            lambda value: value is None or value == {"type": "text"}, '{"type": "text"}', "structured output is not supported"
        ),
        "tools": Refusal(_empty, "[]", "tool calling is not supported"),
        "tool_choice": Refusal(_one_of("none", "auto"), '"none"', "tool calling is not supported"),
        "parallel_tool_calls": Refusal(lambda value: value is None or isinstance(value, bool), "true", "tool calling is not supported"),
        "functions": Refusal(_empty, "[]", "function calling is not supported"),
        "function_call": Refusal(_one_of("none", "auto"), '"none"', "function calling is not supported"),
        "modalities": Refusal(lambda value: value is None or value == ["text"], '["text"]', "only text is generated"),
        "audio": Refusal(_absent, "null", "only text is generated"),
        "prediction": Refusal(_absent, "null", "predicted outputs are not taken yet"),
        "reasoning_effort": Refusal(_absent, "null", "the model has no reasoning setting"),
        "verbosity": Refusal(_absent, "null", "the model has no verbosity setting"),
        "web_search_options": Refusal(_absent, "null", "this server has no web search"),
        "moderation": Refusal(_absent, "null", "this server runs no moderation"),
    }


class CompletionRequest(_Body):
    ENDPOINT: ClassVar[str] = "/v1/completions"

    prompt: Any = None  # a string, token ids, or a list of either, checked by openai_api
    echo: bool | None = None
    logprobs: int | None = None
    # Beyond OpenAI's (vLLM's): each prompt token's log-probability, rank and top n.
    prompt_logprobs: int | None = None
    best_of: Any = None
    suffix: Any = None

    WHAT: ClassVar[dict[str, str]] = _Body.WHAT | {
        "logprobs": "an integer (alternatives per token)",
        "prompt_logprobs": "an integer (alternatives per prompt token)",
    }
    REFUSED: ClassVar[dict[str, Refusal]] = _Body.REFUSED | {
        "best_of": Refusal(_one_of(1), "1", "best_of is not supported"),
        "suffix": Refusal(lambda value: value is None or value == "", "null", "suffix (insertion) is not supported"),
    }


def parse(body: dict, model: type[_Body]) -> Any:
    """``body`` (a JSON object) as ``model``: a 400 naming the first key the endpoint does not
    know, the first refused field not at its no-op, or the first value of the wrong type."""
    for name, value in body.items():
        if name not in model.model_fields:
            raise ApiError(
                400,
                f"unknown field {shown(name)} for {model.ENDPOINT}: this server takes OpenAI's fields and refuses any other "
                "rather than ignore it (docs/guides/openai-api.md lists each field and what is done with it)",
                param=name,
                code="unknown_field",
            )
        refusal = model.REFUSED.get(name)
        if refusal is not None and not refusal.no_op(value):
            raise ApiError(
                400,
                f"{name} is not supported here ({refusal.why}); leave it out or set it to {refusal.no_op_shown}, got {shown(value)}",
                param=name,
                code="unsupported_field",
            )
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        name = str(first["loc"][0])
        what = model.WHAT.get(name) or _KINDS.get(first["type"], "of another type")
        raise ApiError(400, f"{name} must be {what}, got {shown(body.get(name))}", param=name) from None
