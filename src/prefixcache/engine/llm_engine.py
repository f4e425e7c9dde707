"""The engine in one process: input processor -> engine core -> output processor.

``LLMEngine`` is synchronous and single-threaded; ``step()`` runs one batch. The offline ``LLM`` calls
it in a loop. ``prefixcache serve`` uses the same three parts with the core in its own process
(``server/async_llm.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from prefixcache.config import EngineConfig
from prefixcache.core import PrefixLookup
from prefixcache.core.retention import RetentionRange
from prefixcache.engine.core import EngineCore
from prefixcache.engine.input_processor import InputProcessor, PromptInput
from prefixcache.engine.messages import EngineStats
from prefixcache.engine.output_processor import OutputProcessor
from prefixcache.engine.outputs import RequestOutput
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.model import LoadedModel

__all__ = ["EngineStats", "LLMEngine", "PromptInput"]


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.core = EngineCore(config, loaded)
        self.info = self.core.info()
        self.tokenizer = self.core.loaded.tokenizer
        self.input_processor = InputProcessor(self.tokenizer, self.info)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def add_request(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        retention: Sequence[RetentionRange] = (),
        tenant: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Raises ValueError for input the engine cannot serve.

        ``retention``: token ranges of the prompt to keep cached at a priority, for a TTL (``RetentionRange``)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.core.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        request, text = self.input_processor.process(
            prompt, sampling_params or SamplingParams(), request_id, cache_salt, lora_name, tuple(retention), tenant
        )
        self.core.add_request(request)
        self.output_processor.add_request(request, text)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False when it is not in flight."""
        self.core.abort_requests([request_id])
        return self.output_processor.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def progress(self, request_id: str) -> tuple[int, int]:
        """How far a request in flight is, in tokens: (prompt tokens computed or cached plus output tokens,
        prompt tokens plus ``max_tokens``); (0, 0) when it is not in flight."""
        request = self.core.requests.get(request_id)
        if request is None:
            return 0, 0
        prompt = request.num_prompt_tokens
        done = min(request.num_computed_tokens, prompt) + request.num_output_tokens
        return done, prompt + request.sampling_params.max_tokens

    def step(self) -> list[RequestOutput]:
        """Run one batch; an output for every request that advanced."""
        outputs, stopped = self.output_processor.process_outputs(self.core.step().outputs)
        self.core.abort_requests(stopped)
        return outputs

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        return self.input_processor.apply_chat_template(messages, add_generation_prompt)

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> dict[str, Any]:
        """The conversation as a prompt of token ids, with the message ends as checkpoint hints on a model with
        recurrent layers (``InputProcessor.chat_prompt``)."""
        return self.input_processor.chat_prompt(messages, add_generation_prompt=add_generation_prompt)[0]

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def lookup(self, prompt: PromptInput, cache_salt: str | None = None, lora_name: str | None = None) -> PrefixLookup:
        """How much of ``prompt`` the prefix cache holds now; runs no model and leaves the eviction order alone."""
        _, token_ids = self.input_processor.prompt_token_ids(prompt)  # tokenized as ``add_request`` does
        return self.core.lookup(token_ids, cache_salt, lora_name)

    def close(self) -> None:
        self.core.close()

    def stats(self) -> EngineStats:
        return self.core.stats()
