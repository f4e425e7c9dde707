"""OpenAI's choice objects, whole and as stream deltas, with log-probabilities in each endpoint's shape.

Completions: ``{"text", "logprobs": {"tokens", "token_logprobs", "top_logprobs", "text_offset"}}``, where
``top_logprobs`` maps token text to log-probability (the sampled token and the top ``logprobs``, so up to
``logprobs + 1`` entries, as OpenAI documents); with ``echo`` the prompt's text and log-probabilities come
first (the first prompt token has none). Chat: ``{"message" | "delta", "logprobs": {"content": [{"token",
"logprob", "bytes", "top_logprobs": [...]}]}}`` with exactly ``top_logprobs`` alternatives, best first.
Log-probabilities that are not finite (a token the model rules out) are reported as -9999.0, as vLLM
does, since JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from prefixcache.engine import RequestOutput

UNREPRESENTABLE_LOGPROB = -9999.0


@dataclass(frozen=True, slots=True)
class Endpoint:
    """How one endpoint names its objects (``text`` choices for completions, ``message``/``delta`` for chat)."""

    id_prefix: str
    object: str
    chunk_object: str
    chat: bool


COMPLETION = Endpoint("cmpl", "text_completion", "text_completion", chat=False)
CHAT = Endpoint("chatcmpl", "chat.completion", "chat.completion.chunk", chat=True)


@dataclass(slots=True)
class ChoiceShaper:
    """Shapes one request's choices; remembers per choice what a stream already sent (role, echo, offsets).

    ``num_logprobs`` is None when the request asked for no log-probabilities; ``token_text`` decodes one id.
    ``prompt_only`` (echo with ``max_tokens: 0``) shows the prompt alone: the one token the engine sampled to
    finish the request is no part of the answer.
    """

    endpoint: Endpoint
    token_text: Callable[[int], str]
    num_logprobs: int | None = None
    echo: bool = False
    decode: Callable[[list[int]], str] | None = None
    prompt_only: bool = False
    _started: set[int] = field(default_factory=set)
    _text_offsets: dict[int, int] = field(default_factory=dict)

    def visible(self, output: RequestOutput) -> RequestOutput:
        """The output as the client sees it: without its generated token when ``prompt_only``."""
        if not self.prompt_only:
            return output
        completion = output.outputs[0]
        shown = replace(
            completion,
            text="",
            token_ids=[],
            finish_reason="length" if output.finished and completion.error is None else completion.finish_reason,
            stop_reason=None,
            logprobs=None if completion.logprobs is None else [],
        )
        return replace(output, outputs=[shown], new_token_ids=[], new_text="")

    def choice(self, index: int, output: RequestOutput) -> dict[str, Any]:
        completion = output.outputs[0]
        if self.endpoint.chat:
            body: dict[str, Any] = {"message": {"role": "assistant", "content": completion.text}}
            logprobs = self._chat_logprobs(completion.token_ids, completion.logprobs)
        else:
            prompt_text = self._prompt_text(output) if self.echo else ""
            body = {"text": prompt_text + completion.text}
            logprobs = self._completion_logprobs(index, output, completion.token_ids, completion.logprobs or [])
        return {"index": index, **body, "logprobs": logprobs, **_finish(output)}

    def delta(self, index: int, output: RequestOutput) -> dict[str, Any]:
        completion = output.outputs[0]
        first = index not in self._started
        self._started.add(index)
        new_ids = output.new_token_ids
        new_logprobs = (completion.logprobs or [])[len(completion.logprobs or []) - len(new_ids) :]
        if self.endpoint.chat:
            delta = {"role": "assistant", "content": output.new_text} if first else {"content": output.new_text}
            body: dict[str, Any] = {"delta": delta}
            logprobs = self._chat_logprobs(new_ids, new_logprobs)
        else:
            echoed = self._prompt_text(output) if self.echo and first else ""
            body = {"text": echoed + output.new_text}
            logprobs = self._completion_logprobs(index, output, new_ids, new_logprobs, with_prompt=self.echo and first)
        return {"index": index, **body, "logprobs": logprobs, **_finish(output)}

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.decode(output.prompt_token_ids) if self.decode is not None else ""

    def _completion_logprobs(
        self,
        index: int,
        output: RequestOutput,
        token_ids: list[int],
        entries: list[dict[int, float]],
        with_prompt: bool = True,
    ) -> dict[str, Any] | None:
        if self.num_logprobs is None:
            return None
        ids: list[int] = []
        positions: list[dict[int, float] | None] = []
        if self.echo and with_prompt:
            ids += output.prompt_token_ids
            positions += output.prompt_logprobs or [None] * len(output.prompt_token_ids)
        ids += token_ids
        positions += entries
        offset = self._text_offsets.get(index, 0)
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for token_id, entry in zip(ids, positions, strict=True):
            text = self.token_text(token_id)
            tokens.append(text)
            token_logprobs.append(None if entry is None else _finite(entry[token_id]))
            top_logprobs.append(None if entry is None else {self.token_text(t): _finite(lp) for t, lp in entry.items()})
            text_offset.append(offset)
            offset += len(text)
        self._text_offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }

    def _chat_logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None) -> dict[str, Any] | None:
        if self.num_logprobs is None:
            return None
        content = []
        for token_id, entry in zip(token_ids, entries or [], strict=True):
            top = sorted(entry.items(), key=lambda item: item[1], reverse=True)[: self.num_logprobs]
            content.append(
                {**self._chat_token(token_id, entry[token_id]), "top_logprobs": [self._chat_token(*t) for t in top]}
            )
        return {"content": content}

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}


def _finish(output: RequestOutput) -> dict[str, Any]:
    completion = output.outputs[0]
    return {"finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else UNREPRESENTABLE_LOGPROB
