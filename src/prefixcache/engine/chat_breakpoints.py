"""The chat template: a conversation's prompt token ids, and where the template puts the end of a marked part
(the token positions of ``cache_control`` breakpoints, and of the message ends a recurrent model checkpoints at).

A breakpoint means "the prefix up to the end of this part" (a tool definition, a message, a content part). The
template decides what surrounds each part, so the end is found by rendering, never by guessing the template's
format: the conversation is rendered as it is and again with something different right after the part (a marker
appended to the part's text; the conversation cut after the message; another tool after the tool), and the end is
where the renders first differ (a template that refuses the conversation cut after a message gives that
message's breakpoint its content's end). Taken against the real render it is always a prefix of the real prompt, so a
template that trims or rewrites a part only moves the breakpoint earlier, never past what the prompt holds. The
character position becomes a token position as the longest run of tokens the prefix's tokenization shares with
the prompt's, so a token that straddles the end is left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from jinja2 import TemplateError

# Two private-use characters: no text a template adds starts with either, so one of them diverges right at a part's end.
_MARKERS = ("\ue000", "\ue001")
_DUMMY_TOOL = {
    "type": "function",
    "function": {"name": "\ue000", "description": "\ue001", "parameters": {"type": "object", "properties": {}}},
}


class ChatTemplateError(ValueError):
    """A conversation this model's chat template cannot place (``param`` names the request field)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """The end of a part: tool ``index`` (``kind="tool"``); message ``index`` with its closing tokens
    (``"message"``); or ``chars`` characters into message ``index``'s content string, where a content part ends
    (``"content"``: parts are joined into the one string templates take)."""

    kind: Literal["tool", "message", "content"]
    index: int
    chars: int = 0


def chat_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The conversation as the model's own chat template writes it (its special tokens are in the text; given
    ``tools``, the definitions it renders for the model to read)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )


def chat_token_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The conversation as prompt token ids: the template's text tokenized as transformers does it (no special
    tokens beyond the template's, unless ``add_special_tokens``, vLLM's chat field, asks for them on top)."""
    text = chat_text(tokenizer, messages, add_generation_prompt, tools)
    return chat_text_token_ids(tokenizer, text, add_special_tokens)


def chat_text_token_ids(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    """A rendered conversation's token ids (the router renders it first to bound its length)."""
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def chat_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    breakpoints: Sequence[Breakpoint],
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
) -> tuple[list[int], list[int]]:
    """The conversation's prompt token ids and each breakpoint's token position (the number of prompt tokens
    before it). ``ChatTemplateError`` when the template drops the tools it was given (with or without
    breakpoints)."""
    token_ids = chat_token_ids(tokenizer, messages, add_generation_prompt, add_special_tokens, tools)
    if not breakpoints and not tools:
        return token_ids, []

    def render(msgs: list[dict[str, Any]], tool_list: list[dict[str, Any]] | None, generation: bool) -> str:
        kwargs = {"tools": tool_list} if tool_list else {}
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=generation, tokenize=False, **kwargs)

    text = render(messages, tools, add_generation_prompt)
    if tools and text == render(messages, None, add_generation_prompt):
        # Dropped silently, the model would answer without the tools the client believes it was given.
        raise ChatTemplateError("this model's chat template does not render tools; send them without", "tools")

    def variants(point: Breakpoint) -> list[str]:
        if point.kind == "tool":
            kept = tools[: point.index + 1]
            return [render(messages, kept, add_generation_prompt), render(messages, [*kept, _DUMMY_TOOL], False)]
        content = messages[point.index]["content"]
        if point.kind == "message":
            try:
                return [render(messages[: point.index + 1], tools, False)]
            except TemplateError:  # a template that refuses a conversation ending here: the content's end
                return variants(Breakpoint("content", point.index, len(content)))
        return [
            render(
                _with_content(messages, point.index, content[: point.chars] + marker + content[point.chars :]),
                tools,
                add_generation_prompt,
            )
            for marker in _MARKERS
        ]

    positions = []
    for point in breakpoints:
        end = min(_common_prefix(text, variant) for variant in variants(point))
        prefix_ids = tokenizer(text[:end], add_special_tokens=add_special_tokens)["input_ids"]
        positions.append(_common_prefix(prefix_ids, token_ids))
    return token_ids, positions


def _with_content(messages: list[dict[str, Any]], index: int, content: str) -> list[dict[str, Any]]:
    return [*messages[:index], {**messages[index], "content": content}, *messages[index + 1 :]]


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    limit = min(len(a), len(b))
    for i in range(limit):
        if a[i] != b[i]:
            return i
    return limit
