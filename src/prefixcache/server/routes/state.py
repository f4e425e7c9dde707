"""What handlers share: the engine and the settings on ``app.state``, the model-name check, the chat template
(with the token positions of ``cache_control`` breakpoints)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request
from jinja2 import TemplateError

from prefixcache.core.retention import RetentionRange
from prefixcache.engine.chat_breakpoints import Breakpoint, ChatTemplateError
from prefixcache.http.retention import CacheControl, breakpoint_ranges
from prefixcache.server.async_llm import AsyncLLM
from prefixcache.server.errors import APIError
from prefixcache.server.settings import ServerSettings


def engine_of(request: Request) -> AsyncLLM:
    return request.app.state.engine


def settings_of(request: Request) -> ServerSettings:
    return request.app.state.settings


Engine = Annotated[AsyncLLM, Depends(engine_of)]
Settings = Annotated[ServerSettings, Depends(settings_of)]


def model_name(settings: ServerSettings, requested: str | None) -> str:
    """The served name a request asked for (the first one when it names none); 404 for any other name."""
    if requested is None:
        return settings.served_model_names[0]
    if requested not in settings.served_model_names:
        raise APIError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")
    return requested


async def apply_chat_template(
    engine: AsyncLLM, messages: list[Any], add_generation_prompt: bool = True, add_special_tokens: bool = False
) -> list[int]:
    """The conversation's prompt token ids; a template that fails on these messages is the client's 400."""
    try:
        conversation = [m.template_dict() for m in messages]
        return await engine.apply_chat_template(conversation, add_generation_prompt, add_special_tokens)
    except (ValueError, TemplateError) as exc:
        raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc


async def chat_prompt(
    engine: AsyncLLM,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    marks: list[tuple[Breakpoint, CacheControl]] | None = None,
    add_special_tokens: bool = False,
) -> tuple[dict[str, Any], list[RetentionRange]]:
    """The conversation as a prompt dict of token ids (``tools`` rendered by the template; the message ends as
    checkpoint hints on a recurrent model) and the retention ranges of its ``cache_control`` breakpoints; a
    template that fails on them is the client's 400, naming the field."""
    marks = marks or []
    try:
        prompt, positions = await engine.chat_prompt(messages, tools, [point for point, _ in marks], add_special_tokens)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc
    except (ValueError, TemplateError) as exc:
        raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
    return prompt, breakpoint_ranges(positions, [control for _, control in marks])
