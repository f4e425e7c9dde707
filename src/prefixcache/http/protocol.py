"""The OpenAI API as prefixcache serves it: request bodies (validated by pydantic), usage and errors.

Types and shapes are checked here; value ranges (max_tokens, temperature, penalties, logprobs, stop lists)
by :class:`~prefixcache.engine.SamplingParams` and the engine, so the server and the offline API accept
exactly the same requests.

Every field a body may carry is declared: OpenAI's, vLLM's and SGLang's that this server honours (the
README's table lists each with what it does). Any other field, whether one this server does not implement
(``best_of``, ``response_format``, ``tools``, ``logit_bias``, ``suffix``, ...) or a typo, is refused with a
400 that names it and says what to use instead, as OpenAI refuses unrecognized arguments: an ignored
parameter would let a user believe it took effect. A field whose value asks for what this server always
does (SGLang's ``return_hidden_states: false``) is accepted; the value that asks for more is refused by
name. Strings holding a lone surrogate (the JSON escape ``"\\ud800"`` is not Unicode text) are refused.

Types are strict, as OpenAI's API checks them: ``"yes"`` or ``1`` is not a boolean, ``2.0`` or ``"2"`` not a
token count (a float field takes an integer); a message's ``role`` is one of OpenAI's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, StrictBool, StrictInt, field_validator, model_validator
from starlette.responses import JSONResponse

from prefixcache.engine import RequestOutput, SamplingParams
from prefixcache.engine.chat_breakpoints import Breakpoint
from prefixcache.http.retention import (
    CacheControl,
    PromptCacheRetention,
    TokenRangeRetention,
    check_breakpoint_count,
    part_breakpoints,
    written_by_ttl,
)

MAX_CACHE_SALT_LEN = 128
MAX_PROMPT_CACHE_KEY_LEN = 1024
MAX_CHOICES = 128  # prompts times n in one request

# What to use instead of a field this server does not implement, for the 400 that refuses it.
UNSUPPORTED_FIELD_HINTS = {
    "best_of": "for several samples of one prompt, use n",
    "use_beam_search": "beam search is not implemented; use temperature 0 for greedy, or n with a seed",
    "length_penalty": "beam search is not implemented; use temperature 0 for greedy, or n with a seed",
    "suffix": "insertion is not implemented; send the text before the gap as the prompt",
    "logit_bias": "no per-token bias is applied; to control stopping use stop, stop_token_ids or min_tokens",
    "response_format": "structured (JSON) output is not implemented",
    "structured_outputs": "structured (JSON) output is not implemented",
    "guided_json": "structured (JSON) output is not implemented",
    "tools": "tool calling is not implemented; /v1/chat/completions and /v1/messages take tool definitions for the "
    "chat template to render",
    "tool_choice": "tool calling is not implemented",
    "functions": "tool calling is not implemented",
    "function_call": "tool calling is not implemented",
    "parallel_tool_calls": "tool calling is not implemented",
    "prompt_logprobs": "for the prompt's log-probabilities use a completion with echo and logprobs",
    "truncation_side": "truncate_prompt_tokens always keeps the prompt's last tokens (vLLM's default side)",
}


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"invalid Unicode: a lone surrogate at character {exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


def only_false(what_we_do: str) -> Any:
    """A boolean field accepted at false, what this server always does; true asks for what it lacks and is a
    400 saying ``what_we_do`` instead."""

    def check(wanted: bool) -> bool:
        if wanted:
            raise ValueError(f"true is not implemented: {what_we_do}; send false or leave it out")
        return wanted

    return Annotated[bool, AfterValidator(check)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """OpenAI's fields are nullable: a declared field sent as null takes its default (clients that send
        every field, ``"n": null`` and ``"logprobs": null`` among them, are answered, not refused)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


class StreamOptions(_Body):
    """``continuous_usage_stats`` (vLLM's) puts the choice's usage so far in every chunk; like vLLM, only
    together with ``include_usage``, and refused without it rather than ignored."""

    include_usage: bool = False
    continuous_usage_stats: bool = False

    @model_validator(mode="after")
    def _continuous_needs_usage(self) -> StreamOptions:
        if self.continuous_usage_stats and not self.include_usage:
            raise ValueError("continuous_usage_stats needs include_usage: true")
        return self


class _GenerationRequest(_Body):
    """Fields common to both endpoints. vLLM's extensions: ``top_k``, ``min_p``, ``repetition_penalty``,
    ``stop_token_ids``, ``ignore_eos``, ``min_tokens``, ``include_stop_str_in_output``, ``skip_special_tokens``,
    ``spaces_between_special_tokens``, ``truncate_prompt_tokens``, ``return_tokens_as_token_ids``
    (log-probabilities name tokens ``token_id:<id>``, exact where one token's text is a fragment of a
    character) and ``cache_salt``. SGLang's ``no_stop_trim`` (true: keep the stop string, as
    ``include_stop_str_in_output``) and ``return_hidden_states`` (only false). OpenAI's ``prompt_cache_key``
    is accepted for routers (``prefixcache router`` sends one key's requests to one backend); it changes
    neither what is cached nor who may read it, which only the API key's tenant and ``cache_salt`` decide."""

    model: Text | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[StrictInt] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    return_tokens_as_token_ids: bool = False
    return_hidden_states: only_false(
        "this server returns text, token log-probabilities and usage, no hidden states"
    ) = False
    cache_salt: Text | None = None
    prompt_cache_key: Text | None = None
    # Retention directives (http/retention.py): token ranges, and OpenAI's prompt_cache_retention.
    retention: list[TokenRangeRetention] | None = None
    prompt_cache_retention: PromptCacheRetention | None = None

    @field_validator("n")
    @classmethod
    def _valid_n(cls, n: int) -> int:
        if not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}]")
        return n

    @field_validator("cache_salt")
    @classmethod
    def _valid_salt(cls, salt: str | None) -> str | None:
        """A salt is a tenant's cache key: an empty one would silently share, a huge one bloats every hash."""
        if salt is not None and (not salt or len(salt) > MAX_CACHE_SALT_LEN or not salt.isprintable()):
            raise ValueError(f"cache_salt must be 1 to {MAX_CACHE_SALT_LEN} printable characters")
        return salt

    @field_validator("prompt_cache_key")
    @classmethod
    def _valid_prompt_cache_key(cls, key: str | None) -> str | None:
        if key is not None and len(key) > MAX_PROMPT_CACHE_KEY_LEN:
            raise ValueError(f"prompt_cache_key must be at most {MAX_PROMPT_CACHE_KEY_LEN} characters")
        return key

    @model_validator(mode="after")
    def _options_need_stream(self) -> _GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def has_directives(self) -> bool:
        """Whether the request says what to retain (its usage then reports the retained tokens)."""
        return bool(self.retention) or self.prompt_cache_retention is not None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (vLLM's ``stream_options.continuous_usage_stats``)."""
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def sampling_params(
        self, max_tokens: int, logprobs: int | None = None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """Raises InvalidParameter for out-of-range values. ``top_k`` -1 (vLLM's "off") maps to the engine's 0."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            stop=self.stop or (),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output or self.no_stop_trim,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            min_p=self.min_p or 0.0,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )


class CompletionRequest(_GenerationRequest):
    """``prompt``: a text, a list of texts, a list of token ids, or a list of such lists (one choice set each).

    ``echo`` with ``max_tokens: 0`` scores the prompt (the legacy API's way): the choice is the prompt, with
    its log-probabilities when ``logprobs`` is set, and nothing is generated.
    """

    prompt: Text | list[Text] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = 16  # OpenAI's default for legacy completions
    echo: bool = False
    logprobs: StrictInt | None = None
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's BOS (token ids never do)

    @model_validator(mode="after")
    def _bounded(self) -> CompletionRequest:
        if not self.prompt:
            raise ValueError("prompt must not be empty")
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise ValueError(f"prompts times n must be at most {MAX_CHOICES}")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 only scores a prompt, with echo: true; to generate, max_tokens >= 1")
        return self

    @property
    def prompt_only(self) -> bool:
        """Echo the prompt and generate nothing (``echo`` with ``max_tokens: 0``)."""
        return self.echo and self.max_tokens == 0

    @property
    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextPart(_Body):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None


CHAT_ROLES = ("system", "developer", "user", "assistant")


def _chat_role(role: str) -> str:
    if role not in CHAT_ROLES:
        raise ValueError(
            f"role must be one of {', '.join(CHAT_ROLES)}, not {role!r} (a tool's message needs tool calling, "
            "which this server does not implement)"
        )
    return role


class ChatMessage(_Body):
    """OpenAI's roles (checked after the text itself, so a lone surrogate is named as such). ``cache_control``
    on the message, or on its content parts, is a retention breakpoint (``http/retention.py``)."""

    role: Annotated[Text, AfterValidator(_chat_role)]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    cache_control: CacheControl | None = None

    def breakpoints(self, index: int) -> list[tuple[Breakpoint, CacheControl]]:
        """This message's breakpoints, as message ``index`` of the conversation: one at the end of each marked
        content part (in the joined content string), one after the message when it is marked itself."""
        marks = part_breakpoints(self.content, index) if isinstance(self.content, list) else []
        if self.cache_control is not None:
            marks.append((Breakpoint("message", index), self.cache_control))
        return marks

    def template_dict(self) -> dict[str, str]:
        """The message as chat templates expect it: content parts joined into one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class FunctionDefinition(_Body):
    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Body):
    """An OpenAI tool definition, with Anthropic's ``cache_control`` as a breakpoint after it."""

    type: Literal["function"]
    function: FunctionDefinition
    cache_control: CacheControl | None = None

    def template_dict(self) -> dict[str, Any]:
        """The definition as chat templates take ``tools``."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


def conversation_breakpoints(
    messages: Sequence[ChatMessage], tools: Sequence[ChatTool] | None
) -> list[tuple[Breakpoint, CacheControl]]:
    """Every ``cache_control`` of a conversation, tools first, then the messages in order (the order the template
    renders them in)."""
    marks = [(Breakpoint("tool", i), t.cache_control) for i, t in enumerate(tools or ()) if t.cache_control]
    for index, message in enumerate(messages):
        marks.extend(message.breakpoints(index))
    return marks


class ChatCompletionRequest(_GenerationRequest):
    """``continue_final_message`` (vLLM's and SGLang's) is accepted as false only: the reply always starts a new
    assistant message. The reasoning switches, SGLang's ``separate_reasoning`` and ``stream_reasoning`` and
    vLLM's ``include_reasoning``, act only with a reasoning parser, which this server, like either of them
    started without ``--reasoning-parser``, does not have: the model's text comes back whole in ``content``
    whatever their value (sglang-router and vllm-router send them with every chat request).

    ``tools`` go to the chat template, which renders them for the model to read (a template that does not is a
    400); a call the model writes comes back as its text in ``content``, not parsed into ``tool_calls``."""

    messages: list[ChatMessage]
    tools: list[ChatTool] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    continue_final_message: only_false("the reply always starts a new assistant message after the last one") = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True
    add_special_tokens: bool = False  # vLLM's: the chat template writes the special tokens; true adds more

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("messages must not be empty")
        return messages

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs is only allowed when logprobs is true")
        return self

    @model_validator(mode="after")
    def _bounded_breakpoints(self) -> ChatCompletionRequest:
        marks = self.breakpoints()
        check_breakpoint_count(len(marks))
        if marks and self.truncate_prompt_tokens is not None:
            raise ValueError(
                "cache_control breakpoints mark the whole prompt; they cannot be combined with truncate_prompt_tokens"
            )
        return self

    @property
    def has_directives(self) -> bool:
        return super().has_directives or bool(self.breakpoints())

    def template_messages(self) -> list[dict[str, str]]:
        return [message.template_dict() for message in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return None if not self.tools else [tool.template_dict() for tool in self.tools]

    def breakpoints(self) -> list[tuple[Breakpoint, CacheControl]]:
        return conversation_breakpoints(self.messages, self.tools)

    @property
    def num_logprobs(self) -> int | None:
        """The engine's ``logprobs``: None when not asked, else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a ``prompt`` or chat ``messages``, tokenized as the completions or the chat endpoint
    does (``add_special_tokens`` defaults, as there, to true for a prompt and false for messages)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self

    @property
    def special_tokens(self) -> bool:
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return adds_special_tokens({}, chat=self.messages is not None)


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[StrictInt]


class CompletionLookupRequest(CompletionRequest):
    """``POST /v1/cache/lookup`` with a completion body: one prompt. ``return_token_ids`` adds the prompt's
    token ids and each token's text to the answer (what ``prefixcache explain --base-url`` reads)."""

    return_token_ids: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionLookupRequest:
        if len(self.prompts) > 1:
            raise ValueError("a lookup takes one prompt; send one lookup per prompt")
        return self


class ChatLookupRequest(ChatCompletionRequest):
    """``POST /v1/cache/lookup`` with a chat body; ``return_token_ids`` as for a completion body."""

    return_token_ids: bool = False


def lookup_request(body: dict[str, Any]) -> CompletionLookupRequest | ChatLookupRequest:
    """A lookup body is the body its endpoint takes, validated the same way (its sampling fields are parsed,
    not used): a chat body when it has ``messages``, else a completion body. ValueError for both or neither;
    pydantic's ValidationError for a body its endpoint would refuse."""
    if ("prompt" in body) == ("messages" in body):
        raise ValueError("send either prompt (a completion body) or messages (a chat body)")
    model = ChatLookupRequest if "messages" in body else CompletionLookupRequest
    return model.model_validate(body)


def adds_special_tokens(body: Mapping[str, Any], chat: bool) -> bool:
    """Whether the server gives a raw body's prompt the tokenizer's special tokens (its ``add_special_tokens``,
    defaulted as the endpoint's model defaults it), for the router and ``explain``, which read bodies as logged."""
    value = body.get("add_special_tokens")
    if isinstance(value, bool):
        return value
    endpoint = ChatCompletionRequest if chat else CompletionRequest
    return endpoint.model_fields["add_special_tokens"].default


def usage(outputs: Mapping[int, RequestOutput], n: int, retention: bool = False) -> dict[str, Any]:
    """OpenAI's usage block over the choices seen so far, keyed by choice index (``n`` choices per prompt).

    A prompt counts once however many choices it has; its ``cached_tokens`` is the least any of its copies
    read from the prefix cache (the copies after the first usually read all of it). With ``retention`` (the
    request gave directives) ``prompt_tokens_details`` also has ``retained_written_tokens`` (the most any copy
    wrote into retained blocks), split by how long they are kept into ``retained_written_5m_tokens`` and
    ``retained_written_1h_tokens`` (Anthropic's ``cache_creation`` split), and ``retained_read_tokens`` (the least
    any copy read from them), and ``retention_clamped`` says why the engine clamped a directive, when it did.
    """
    per_prompt: dict[int, list[RequestOutput]] = {}
    for index, output in outputs.items():
        per_prompt.setdefault(index // n, []).append(output)
    prompt_tokens = sum(len(copies[0].prompt_token_ids) for copies in per_prompt.values())
    cached_tokens = sum(min(o.num_cached_tokens for o in copies) for copies in per_prompt.values())
    completion_tokens = sum(len(o.outputs[0].token_ids) for o in outputs.values())
    counts = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if retention:
        counts["prompt_tokens_details"].update(retained_usage(per_prompt.values()))
        clamped = next((o.retention_clamped for o in outputs.values() if o.retention_clamped), None)
        if clamped is not None:
            counts["retention_clamped"] = clamped
    return counts


def retained_usage(per_prompt: Iterable[Sequence[RequestOutput]]) -> dict[str, int]:
    """Prompt tokens written into (and split by TTL) and read from retained blocks, summed over prompts; a
    prompt's copies (its ``n`` choices) count as the one that wrote most and the one that read least."""
    per_prompt = list(per_prompt)
    writers = [max(copies, key=lambda o: o.num_retained_written_tokens) for copies in per_prompt]
    splits = [written_by_ttl(writer.num_retained_written_tokens_by_ttl) for writer in writers]
    return {
        "retained_written_tokens": sum(writer.num_retained_written_tokens for writer in writers),
        "retained_written_5m_tokens": sum(short for short, _ in splits),
        "retained_written_1h_tokens": sum(longer for _, longer in splits),
        "retained_read_tokens": sum(min(o.num_retained_read_tokens for o in copies) for copies in per_prompt),
    }


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ErrorResponse(JSONResponse):
    """JSON with non-ASCII escaped: a message may quote client input, which need not be encodable text."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def error_response(
    status_code: int, message: str, headers: dict[str, str] | None = None, **kwargs: Any
) -> ErrorResponse:
    """OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with ``status_code``."""
    return ErrorResponse(error_body(message, **kwargs), status_code=status_code, headers=headers)
