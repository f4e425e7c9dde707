"""What handlers share: the engine and the settings on ``app.state``, the model-name check, the chat template."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request
from jinja2 import TemplateError

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
