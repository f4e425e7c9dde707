"""Input processing: prompts and chat messages in, validated ``EngineCoreRequest``s of token ids out.

Every check a request can fail happens here, before the core sees it, so a bad request costs the
engine nothing and gets a clear ``ValueError``. Runs on the API side (tokenizing never blocks a step).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefixcache.core.retention import RetentionRange, check_retention
from prefixcache.engine.chat_breakpoints import Breakpoint, chat_prompt, chat_token_ids
from prefixcache.engine.messages import EngineCoreRequest, EngineInfo
from prefixcache.engine.sampling_params import SamplingParams

PromptInput = str | list[int] | dict[str, Any]


@dataclass(frozen=True, slots=True)
class PromptOptions:
    """How a request's prompt becomes the tokens it runs on, beside its sampling (vLLM's request fields).

    ``add_special_tokens``: a text prompt gets what the tokenizer adds around a text (Llama's, Gemma's or
    Mistral's BOS), as vLLM's completions and its offline ``generate`` do; without it such models answer
    from a context they were never trained on. Token ids and chat templates are taken as they are.
    ``prompt_only`` (echo with ``max_tokens: 0``): the request scores its prompt, so the one token the engine
    samples after it, never shown, needs no room in the context or the KV cache.
    """

    add_special_tokens: bool = True
    prompt_only: bool = False


DEFAULT_PROMPT_OPTIONS = PromptOptions()


class InputProcessor:
    def __init__(self, tokenizer: Any, info: EngineInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info
        # Message ends are worth their renders only where they place state checkpoints.
        self.hints_message_ends = info.enable_prefix_caching and any(g.recurrent_state for g in info.kv_cache_groups)

    def prompt_token_ids(
        self, prompt: PromptInput, keep_last: int | None = None, add_special_tokens: bool = True
    ) -> tuple[str | None, list[int]]:
        """The prompt's text (None when it came as token ids, or was cut) and its token ids, checked against the
        vocabulary and the context length; ``keep_last`` cuts a longer prompt to its last tokens first. A text
        cut so keeps the special tokens its tokenizer put around it (the BOS), as a tokenizer truncating from
        the left does in vLLM: the model still reads a well-formed start."""
        text, token_ids = tokenize_prompt(self.tokenizer, prompt, add_special_tokens)
        if keep_last is not None and len(token_ids) > keep_last:
            wrapped = add_special_tokens and _is_text(prompt)
            before, after = self._special_wrapping if wrapped else (0, 0)
            if keep_last > before + after:
                end, kept = len(token_ids) - after, keep_last - before - after
                token_ids = token_ids[:before] + token_ids[end - kept : end] + token_ids[end:]
            else:
                token_ids = token_ids[-keep_last:]
            text = None
        if not token_ids:
            raise ValueError("the prompt is empty")
        check_vocabulary(token_ids, self.info.vocab_size)
        if len(token_ids) > self.info.max_model_len:
            raise ValueError(prompt_too_long(len(token_ids), self.info.max_model_len))
        return text, token_ids

    def process(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        retention: tuple[RetentionRange, ...] = (),
        tenant: str | None = None,
        options: PromptOptions = DEFAULT_PROMPT_OPTIONS,
    ) -> tuple[EngineCoreRequest, str | None]:
        """The core request and the prompt text (None when the prompt came as token ids or was truncated).

        ``retention`` ranges index the prompt as it is after truncation; one past it is a ValueError. A prompt
        dict of token ids may carry ``checkpoint_hints`` (positions in them, as :meth:`chat_prompt` puts the
        message ends), which move with a truncation and drop out where it cut them off."""
        vocab_size = self.info.vocab_size
        max_model_len = self.info.max_model_len
        output_room = 0 if options.prompt_only else params.max_tokens
        keep_last = params.truncate_prompt_tokens
        if keep_last == -1:  # as much as fits beside max_tokens, in the context and in the KV cache
            keep_last = max(1, self.info.max_request_tokens - output_room)
        text, token_ids = self.prompt_token_ids(prompt, keep_last, options.add_special_tokens)
        hints = _checkpoint_hints(prompt, len(token_ids))
        if len(token_ids) + output_room > max_model_len:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) plus max_tokens ({output_room}) exceeds the "
                f"model's context length of {max_model_len} tokens"
            )
        capacity = self.info.kv_capacity_tokens
        if len(token_ids) + output_room > capacity:
            raise ValueError(
                f"prompt plus max_tokens ({len(token_ids) + output_room} tokens) cannot fit the KV cache "
                f"of {capacity} tokens; raise --kv-cache-memory or lower max_tokens"
            )
        if params.stop_token_ids and max(params.stop_token_ids) >= vocab_size:
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size})")
        retention = check_retention(retention, len(token_ids))
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            cache_salt=cache_salt,
            lora_name=lora_name,
            retention=retention,
            tenant=tenant,
            checkpoint_hints=hints,
        )
        return request, text

    @functools.cached_property
    def _special_wrapping(self) -> tuple[int, int]:
        """How many ids the tokenizer adds before and after a text (a BOS alone: ``(1, 0)``)."""
        bare = self.tokenizer.encode("a", add_special_tokens=False)
        full = self.tokenizer.encode("a", add_special_tokens=True)
        for start in range(len(full) - len(bare) + 1):
            if full[start : start + len(bare)] == bare:
                return start, len(full) - start - len(bare)
        return 0, 0

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, add_special_tokens: bool = False
    ) -> list[int]:
        return chat_token_ids(self.tokenizer, messages, add_generation_prompt, add_special_tokens)

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        breakpoints: Sequence[Breakpoint] = (),
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> tuple[dict[str, Any], list[int]]:
        """The conversation as a prompt dict of token ids (``tools`` rendered by the template) and the token
        position of each breakpoint (the tokenizer's special tokens on top with ``add_special_tokens``;
        ``ChatTemplateError`` as ``chat_prompt`` raises it).

        On a model with recurrent layers the prompt also carries where each message ends, as
        ``checkpoint_hints``: a later conversation sharing the first messages parts from this one right after
        one of them, and a state checkpoint at that block boundary lets it hit all of them (the core's ``hint``
        rule; without it the second such conversation would hit nothing). Other models skip the renders."""
        hint = self.hints_message_ends
        token_ids, positions, hints = hinted_chat_prompt(
            self.tokenizer, messages, tools, breakpoints, add_generation_prompt, add_special_tokens, hint
        )
        prompt: dict[str, Any] = {"prompt": None, "prompt_token_ids": token_ids}
        if hints:
            prompt["checkpoint_hints"] = hints
        return prompt, positions


def hinted_chat_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    breakpoints: Sequence[Breakpoint],
    add_generation_prompt: bool,
    add_special_tokens: bool,
    hint_message_ends: bool,
) -> tuple[list[int], list[int], list[int]]:
    """The conversation's token ids, the token position of each breakpoint and, with ``hint_message_ends`` (a
    model with recurrent layers), the checkpoint hints: where each message ends, in order (``explain`` places
    them as the server does)."""
    ends = [Breakpoint("message", index) for index in range(len(messages))] if hint_message_ends else []
    token_ids, positions = chat_prompt(
        tokenizer, messages, tools, [*breakpoints, *ends], add_generation_prompt, add_special_tokens
    )
    hints = sorted({position for position in positions[len(breakpoints) :] if position > 0})
    return token_ids, positions[: len(breakpoints)], hints


def _is_text(prompt: PromptInput) -> bool:
    """Whether the prompt's ids come from tokenizing a text here (not ids the caller gave)."""
    if isinstance(prompt, dict):
        return "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str)
    return isinstance(prompt, str)


def prompt_too_long(num_tokens: int | str, max_model_len: int) -> str:
    """The error for a prompt the context cannot hold, in the words of the server and of the router."""
    return f"prompt ({num_tokens} tokens) exceeds the model's context length of {max_model_len} tokens"


def tokenize_prompt(
    tokenizer: Any, prompt: PromptInput, add_special_tokens: bool = True
) -> tuple[str | None, list[int]]:
    """The prompt text (None for token ids) and its token ids, a text with the tokenizer's special tokens unless
    ``add_special_tokens`` is false; the router and ``explain`` tokenize through here too."""
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _check_token_ids(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return tokenize_prompt(tokenizer, prompt["prompt"], add_special_tokens)
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, list | tuple):
        return None, _check_token_ids(prompt)
    raise ValueError(f"a prompt is a string, a list of token ids or a dict, not {type(prompt).__name__}")


def check_vocabulary(token_ids: list[int], vocab_size: int) -> None:
    """ValueError unless every id is in the vocabulary; ``explain`` refuses what the server refuses with it."""
    if any(t < 0 or t >= vocab_size for t in token_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")


def _checkpoint_hints(prompt: PromptInput, num_tokens: int) -> tuple[int, ...]:
    """A prompt dict's ``checkpoint_hints`` as positions in its ``num_tokens`` tokens after truncation (which
    keeps the last ones); ValueError for hints that are not positions of its ``prompt_token_ids``."""
    if not isinstance(prompt, dict) or "checkpoint_hints" not in prompt:
        return ()
    hints = prompt["checkpoint_hints"]
    if "prompt_token_ids" not in prompt:
        raise ValueError("checkpoint_hints index a prompt's token ids: send them with prompt_token_ids")
    given = len(prompt["prompt_token_ids"])
    if not isinstance(hints, list | tuple) or not all(
        isinstance(h, int) and not isinstance(h, bool) and 0 < h <= given for h in hints
    ):
        raise ValueError(f"checkpoint_hints must be a list of prompt positions in 1 .. {given}")
    cut = given - num_tokens
    return tuple(h - cut for h in hints if h > cut)


def _check_token_ids(token_ids: Any) -> list[int]:
    if not isinstance(token_ids, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in token_ids
    ):
        raise ValueError("prompt_token_ids must be a list of integers")
    return list(token_ids)
