"""The bodies of ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /tokenize`` and ``POST /detokenize``, declared.

Each body is a pydantic model, parsed from the raw bytes once (``parse``)
and strict: a bool is not a number, "1" is not an integer. The two OpenAI
endpoints' models list every field of OpenAI's API for them, so nothing a
client sends can be dropped without a word:

* a field this server honours is declared with its type (and its range,
  where the range is the request's own: ``seed``, ``top_p``); ``openai_api``
  reads it from the model, and the rules that depend on the server (limits
  from flags, the tokenizer, the model's name) are checked there and in the
  engine, which name the field too;
* a field it does not honour is declared as *refused*, with the value that
  changes nothing (its no-op): set to anything else it is a 400 with code
  ``unsupported_field`` that says why and what to send instead;
* any other key is a 400 with code ``unknown_field`` (``extra="forbid"``).

``user``, ``metadata``, ``safety_identifier`` and the prompt-cache hints
(``prompt_cache_key``, chat's ``prompt_cache_retention`` and
``prompt_cache_options``) only label a request or tune a cache; they change
nothing in the answer, so any JSON value is taken. The tests hold the models
to the ``openai`` package's own request types: every field it can send is
declared here.

pydantic's errors become our 400s (``ApiError``, the field in ``param``) in
words a person can act on: by the kind of value a field takes ("n must be an
integer, got "2""), by its interval ("seed must be in [0, 2**64), got -1"),
or, where a field's type is a union or a structure whose pydantic errors
would name its branches, in the field's own words (``_worded``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from http import HTTPStatus
from typing import Annotated, Any, ClassVar, Literal, TypeVar, get_args

from annotated_types import Ge, Gt, Le, Lt
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails, PydanticCustomError
from pydantic_core.core_schema import ValidatorFunctionWrapHandler
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


# -- errors in our words ---------------------------------------------------------------------

# The error types our validators raise: the whole message is ours (``ctx["message"]``).
INVALID, UNSUPPORTED = "invalid_field", "unsupported_field"


def _invalid(message: str, param: str | None = None) -> PydanticCustomError:
    """An error whose message is ours; ``param`` when it is not the field's own name."""
    return PydanticCustomError(INVALID, "{message}", {"message": message, "param": param})


def _worded(message: str) -> WrapValidator:
    """Every error of the field as ``message`` (pydantic's would name each branch of its union)."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise _invalid(message) from None

    return WrapValidator(validate)


def _refused(no_op: Callable[[Any], bool], no_op_shown: str, why: str) -> AfterValidator:
    """A known field this server does not honour: taken at its no-op (``no_op(value)``), else a
    400 ``unsupported_field`` that says ``why`` and what to send instead (``no_op_shown``)."""

    def check(value: Any, info: ValidationInfo) -> Any:
        if not no_op(value):
            message = f"{info.field_name} is not supported here ({why}); leave it out or set it to {no_op_shown}, got {shown(value)}"
            raise PydanticCustomError(UNSUPPORTED, "{message}", {"message": message, "param": None})
        return value

    return AfterValidator(check)


# The no-ops of refused fields (absent, or null, is every field's).
def _absent(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == []


def _false(value: Any) -> bool:
    return value is None or value is False


def _a_bool(value: Any) -> bool:
    return value is None or isinstance(value, bool)


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or (not isinstance(value, bool) and any(value == allowed for allowed in values))


def _first(errors: list[ErrorDetails]) -> ErrorDetails:
    """The error a 400 names: an unknown key before a refused field before a bad value (each in pydantic's order)."""
    precedence = {"extra_forbidden": 0, UNSUPPORTED: 1}
    return min(errors, key=lambda error: precedence.get(error["type"], 2))


# What a value of each kind must be, in the words of an error message (pydantic's error type -> words).
_KINDS = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "dict_type": "an object",
    "list_type": "a list",
}
_BOUNDS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def _number(value: float) -> str:
    """A bound as a message writes it: 1.0 -> "1", 2**64 -> "2**64"."""
    if isinstance(value, int) and value > 1 << 32 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"
    return f"{value:g}"


def _interval(field: FieldInfo) -> str:
    """A field's bounds (``Field(ge=0, lt=2**64)``) as an interval: "[0, 2**64)"."""
    bounds = {type(item): item for item in field.metadata}
    low = f"[{_number(bounds[Ge].ge)}" if Ge in bounds else f"({_number(bounds[Gt].gt)}"
    high = f"{_number(bounds[Le].le)}]" if Le in bounds else f"{_number(bounds[Lt].lt)})"
    return f"{low}, {high}"


# -- the bodies' parts -------------------------------------------------------------------------

ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
CHAT_ROLES = get_args(ChatRole)


class _Part(BaseModel):
    """Message objects are OpenAI's, whose clients add keys of their own (``name``, ...): those are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Part):
    type: Literal["text"]
    text: str


class ChatMessage(_Part):
    role: ChatRole
    content: str | list[TextPart]  # a list's parts are joined


def _messages_words(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """``messages``' errors, naming the message at fault."""
    try:
        return handler(value)
    except ValidationError as error:
        where = error.errors()[0]["loc"]  # within the list: (index, field, ...)
        if not where:
            raise _invalid("messages must be a non-empty list of {role, content} objects") from None
        index = where[0]
        if len(where) == 1 or where[1] == "role":
            raise _invalid(f"messages[{index}] needs a role, one of {list(CHAT_ROLES)}") from None
        if isinstance(value[index].get("content"), list):
            raise _invalid(f"messages[{index}].content: only text parts are supported") from None
        raise _invalid(f"messages[{index}].content must be a string or a list of text parts") from None


ChatMessages = Annotated[list[ChatMessage], Field(min_length=1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = None  # honoured
    include_obfuscation: Literal[False] | None = None  # refused unless false
    continuous_usage_stats: Literal[False] | None = None  # the same


def _stream_options_words(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """``stream_options``' errors: only include_usage is honoured."""
    try:
        return handler(value)
    except ValidationError as error:
        first = _first(error.errors())
        if not first["loc"]:
            raise _invalid(f"stream_options must be an object, got {shown(value)}") from None
        name = str(first["loc"][0])
        if first["type"] == "extra_forbidden":
            raise _invalid(f"unknown field {shown(name)} in stream_options: only include_usage is taken") from None
        if name == "include_usage":
            raise _invalid(f"include_usage must be true or false, got {shown(first['input'])}", param=name) from None
        raise _invalid("stream_options: only include_usage is supported; leave the others out or false") from None


# A logit_bias key: a token id, as JSON spells an object's keys (a string of ASCII digits).
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]+$"), AfterValidator(int)]


# The validation context's key for the server's check of logit_bias' count (raises ValueError).
CHECK_LOGIT_BIAS_COUNT = "check_logit_bias_count"


def _logit_bias_words(value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
    """``logit_bias``, counted by the server's rule before any entry is read (a map of 100,000s
    takes a while to convert), and its errors, naming the entry at fault."""
    check_count = (info.context or {}).get(CHECK_LOGIT_BIAS_COUNT)
    if check_count is not None and isinstance(value, dict):
        try:
            check_count(len(value))
        except ValueError as error:
            raise _invalid(str(error)) from None
    try:
        return handler(value)
    except ValidationError as error:
        first = error.errors()[0]
        if not first["loc"]:
            raise _invalid(f"logit_bias must be an object of token id -> bias, got {shown(value)}") from None
        key, item = str(first["loc"][0]), first["input"]
        if len(first["loc"]) > 1:  # (key, "[key]"): the key itself
            raise _invalid(f"logit_bias keys are token ids (digits), got {shown(key)}") from None
        if isinstance(item, int) and not isinstance(item, bool):  # refused only as too large for a float
            raise _invalid(f"logit_bias[{key}] must be a finite number") from None
        raise _invalid(f"logit_bias[{key}] must be a number, got {shown(item)}") from None


# -- the bodies ----------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    PATH: ClassVar[str] = ""

    model: str | None = None

    @classmethod
    def unknown(cls, name: str) -> str:
        """What a 400 says of a key the endpoint does not know."""
        return f"unknown field {shown(name)} for {cls.PATH}; it takes {sorted(cls.model_fields)}"


class _Body(_Request):
    """The fields both OpenAI endpoints take."""

    max_tokens: int | None = None
    n: int | None = None
    seed: int | None = Field(None, ge=0, lt=1 << 64)
    stop: Annotated[str | list[str] | None, _worded("stop must be a string or a list of strings")] = None
    stream: bool | None = None
    stream_options: Annotated[StreamOptions | None, WrapValidator(_stream_options_words)] = None
    temperature: float | None = None
    # OpenAI's range; 0 is "off" only on gRPC, where it means unset.
    top_p: float | None = Field(None, gt=0, le=1, description="1: no nucleus filter")
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: Annotated[dict[TokenIdKey, float] | None, WrapValidator(_logit_bias_words)] = None
    # Beyond OpenAI's (vLLM's names): honoured.
    top_k: int | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    num_speculative_tokens: int | None = Field(None, description="unset: adaptive")
    # Labels for the sender: any value, no effect.
    user: JsonValue = None
    metadata: JsonValue = None
    safety_identifier: JsonValue = None
    prompt_cache_key: JsonValue = None
    # Refused unless at their no-op.
    service_tier: Annotated[JsonValue, _refused(_one_of("auto", "default"), '"auto"', "this server has one tier")] = None
    store: Annotated[JsonValue, _refused(_false, "false", "this server stores no completions")] = None

    @classmethod
    def unknown(cls, name: str) -> str:
        return (
            f"unknown field {shown(name)} for {cls.PATH}: this server takes OpenAI's fields and refuses any other "
            "rather than ignore it (docs/guides/openai-api.md lists each field and what is done with it)"
        )


def _tools_refused(no_op: Callable[[Any], bool], no_op_shown: str) -> AfterValidator:
    return _refused(no_op, no_op_shown, "tool calling is not supported")


class ChatCompletionRequest(_Body):
    PATH: ClassVar[str] = "/v1/chat/completions"

    # Absent, it is refused as a bad value is (validate_default runs the check on None).
    messages: Annotated[ChatMessages, WrapValidator(_messages_words)] = Field(None, validate_default=True)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    prompt_cache_retention: JsonValue = None  # a cache hint: any value, no effect
    prompt_cache_options: JsonValue = None  # the same
    # Refused unless at their no-op.
    response_format: Annotated[JsonValue, _refused(_one_of({"type": "text"}), '{"type": "text"}', "structured output is not supported")] = (
        None
    )
    tools: Annotated[JsonValue, _tools_refused(_empty, "[]")] = None
    tool_choice: Annotated[JsonValue, _tools_refused(_one_of("none", "auto"), '"none"')] = None
    parallel_tool_calls: Annotated[JsonValue, _tools_refused(_a_bool, "true")] = None
    functions: Annotated[JsonValue, _refused(_empty, "[]", "function calling is not supported")] = None
    function_call: Annotated[JsonValue, _refused(_one_of("none", "auto"), '"none"', "function calling is not supported")] = None
    modalities: Annotated[JsonValue, _refused(_one_of(["text"]), '["text"]', "only text is generated")] = None
    audio: Annotated[JsonValue, _refused(_absent, "null", "only text is generated")] = None
    prediction: Annotated[JsonValue, _refused(_absent, "null", "predicted outputs are not taken yet")] = None
    reasoning_effort: Annotated[JsonValue, _refused(_absent, "null", "the model has no reasoning setting")] = None
    verbosity: Annotated[JsonValue, _refused(_absent, "null", "the model has no verbosity setting")] = None
    web_search_options: Annotated[JsonValue, _refused(_absent, "null", "this server has no web search")] = None
    moderation: Annotated[JsonValue, _refused(_absent, "null", "this server runs no moderation")] = None


class CompletionRequest(_Body):
    PATH: ClassVar[str] = "/v1/completions"

    # One prompt (a string, or token ids) or a list of them. Absent, it is refused as a bad value is.
    prompt: Annotated[
        str | list[int] | list[str | list[int]],
        _worded("prompt must be a string, a list of token ids, or a list of either (a prompt each)"),
    ] = Field(None, validate_default=True)
    echo: bool | None = None
    logprobs: int | None = Field(None, description="alternatives per token")
    # Beyond OpenAI's (vLLM's): each prompt token's log-probability, rank and top n.
    prompt_logprobs: int | None = Field(None, description="alternatives per prompt token")
    # Refused unless at their no-op.
    best_of: Annotated[JsonValue, _refused(_one_of(1), "1", "best_of is not supported")] = None
    suffix: Annotated[JsonValue, _refused(_one_of(""), "null", "suffix (insertion) is not supported")] = None


class TokenizeRequest(_Request):
    """vLLM's: a prompt, or a chat (tokenized as chat completions see it)."""

    PATH: ClassVar[str] = "/tokenize"

    @model_validator(mode="before")
    @classmethod
    def _one_of_prompt_and_messages(cls, body: Any) -> Any:
        # Null is absent, as in every body here; checked once the keys are known to be ours, so
        # that an unknown one is named first, and before the values, as it says what they must be.
        if isinstance(body, dict) and set(body) <= set(cls.model_fields) and (body.get("prompt") is None) == (body.get("messages") is None):
            raise _invalid("give exactly one of prompt (text) and messages (a chat)", param="prompt")
        return body

    prompt: str | None = None
    messages: Annotated[ChatMessages | None, WrapValidator(_messages_words)] = None
    add_special_tokens: bool | None = None  # unset: true
    add_generation_prompt: bool | None = None  # unset: true, and only true is taken


class DetokenizeRequest(_Request):
    PATH: ClassVar[str] = "/detokenize"

    tokens: Annotated[list[int], _worded("tokens must be a list of token ids")] = Field(None, validate_default=True)


# -- parsing ----------------------------------------------------------------------------------------

Body = TypeVar("Body", bound=_Request)


# What pydantic's parser says of a string that is not Unicode text.
_NOT_TEXT = ("surrogate", "end of hex escape", "invalid unicode code point")


def parse(received: bytes | bytearray, model: type[Body], context: dict[str, Any] | None = None) -> Body:
    """The body as ``model``: a 400 naming the first key the endpoint does not know, else the
    first refused field not at its no-op, else the first value it does not take. ``context``:
    the server's checks the types call (``CHECK_LOGIT_BIAS_COUNT``)."""
    try:
        return model.model_validate_json(received, context=context)
    except ValidationError as error:
        first = _first(error.errors())
        if first["type"] != "json_invalid" or not any(sign in first["ctx"]["error"] for sign in _NOT_TEXT):
            raise _api_error(model, first) from None
    # JSON's escapes can spell a lone surrogate ("\ud800"), and its bytes can too (ed a0 80,
    # which UTF-8 forbids): pydantic's parser refuses either outright, naming no field. The
    # standard parser keeps it in a str, so the field that holds it can say so (openai_api's
    # text checks), and of other bytes that are not UTF-8 it says which.
    try:
        body = json.loads(received)
    except RecursionError:  # the parser's own depth limit (about 1,000 levels)
        raise ApiError(400, "the body nests too deeply to be a request") from None
    except ValueError as error:  # UnicodeDecodeError (not UTF-8) is one too
        raise ApiError(400, f"the body must be a JSON object in UTF-8: {error}") from None
    try:
        return model.model_validate(body, context=context)
    except ValidationError as error:
        raise _api_error(model, _first(error.errors())) from None


def _api_error(model: type[_Request], error: ErrorDetails) -> ApiError:
    """pydantic's ``error`` as our 400, the field in ``param``."""
    kind = error["type"]
    if kind in (INVALID, UNSUPPORTED):
        context, code = error["ctx"], "unsupported_field" if kind == UNSUPPORTED else None
        return ApiError(400, context["message"], param=context["param"] or str(error["loc"][0]), code=code)
    if not error["loc"]:  # the body as a whole
        if kind == "string_unicode":  # a key holding a lone surrogate (parse's standard parser kept it)
            return ApiError(400, "the body's keys must be text: one holds a lone surrogate")
        if kind != "json_invalid":
            return ApiError(400, "the body must be a JSON object")
        detail = error["ctx"]["error"]
        if "recursion limit" in detail:  # no body of ours nests past 4 levels; the parser stops at 200
            return ApiError(400, "the body nests too deeply to be a request")
        return ApiError(400, f"the body must be a JSON object in UTF-8: {detail}")
    name = str(error["loc"][0])
    if kind == "extra_forbidden":
        return ApiError(400, model.unknown(name), param=name, code="unknown_field")
    # A field's description is a note on its bounds where it has them, else on its kind.
    field, got = model.model_fields[name], shown(error["input"])
    note = f" ({field.description})" if field.description else ""
    if kind in _BOUNDS:
        return ApiError(400, f"{name} must be in {_interval(field)}{note}, got {got}", param=name)
    if any(isinstance(item, Ge | Gt | Le | Lt) for item in field.metadata):
        note = ""
    return ApiError(400, f"{name} must be {_KINDS.get(kind, 'of another type')}{note}, got {got}", param=name)
