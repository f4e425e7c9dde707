"""The engine loop: request in -> scheduler -> KV cache manager -> model runner -> outputs.

``LLMEngine`` is synchronous and single-threaded: ``step()`` runs one batch. The offline ``LLM``
calls it in a loop; the server calls it from one background task for all in-flight requests.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from prefixcache.config import EngineConfig, parse_memory
from prefixcache.core import KVCacheManager
from prefixcache.engine.detokenizer import IncrementalDetokenizer
from prefixcache.engine.model_runner import ModelRunner
from prefixcache.engine.outputs import CompletionOutput, RequestOutput
from prefixcache.engine.request import EngineRequest, RequestStatus
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.scheduler import Scheduler
from prefixcache.kv_events.sink import KVEventSink
from prefixcache.model import LoadedModel, load_model

logger = logging.getLogger(__name__)

ROLLING_WINDOW = 1000
PromptInput = str | list[int] | dict[str, Any]


@dataclass(slots=True)
class EngineStats:
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_copied_tokens: int
    prefix_cache_hit_rate: float
    rolling_hit_rate: float
    num_requests: int
    num_preemptions: int
    kv_cache_usage: float
    num_running: int
    num_waiting: int
    num_blocks: int
    block_size: int


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded or load_model(config.model, dtype=config.dtype, device=config.device)
        self.tokenizer = self.loaded.tokenizer
        model_config = self.loaded.config
        self.model_config = model_config
        self.vocab_size = model_config.vocab_size
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings
        )
        enable_caching = config.enable_prefix_caching
        if enable_caching and not model_config.is_causal:
            logger.warning("prefix caching turned off: %s attention is not causal", model_config.architecture)
            enable_caching = False
        dtype = getattr(torch, config.dtype)
        num_blocks = config.num_blocks or parse_memory(config.kv_cache_memory) // self.loaded.model.kv_bytes_per_block(
            config.block_size, dtype
        )
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory={config.kv_cache_memory!r} holds fewer than 2 blocks")
        self.manager = KVCacheManager(
            num_blocks=num_blocks,
            block_size=config.block_size,
            enable_caching=enable_caching,
            hash_algo=config.hash_algo,
            hash_seed=config.hash_seed,
            eviction_policy=config.eviction_policy,
            sub_block_size=config.sub_block_size,
        )
        self.scheduler = Scheduler(self.manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.loaded.model, num_blocks, config.block_size, dtype, config.device, config.seed)
        self.kv_events = KVEventSink.create(config.kv_events_config, self.manager.pool)
        self.requests: dict[str, EngineRequest] = {}
        self._ids = itertools.count()
        self._recent: deque[tuple[int, int]] = deque(maxlen=ROLLING_WINDOW)
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens), prefix caching %s",
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
            "on" if enable_caching else "off",
        )

    def add_request(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> EngineRequest:
        """Validate and queue a request. Raises ValueError for input the engine cannot serve."""
        params = sampling_params or SamplingParams()
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if any(t < 0 or t >= self.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"model's context length of {self.max_model_len} tokens"
            )
        capacity = self.manager.num_blocks * self.manager.block_size
        if len(token_ids) + params.max_tokens > capacity:
            raise ValueError(
                f"prompt plus max_tokens ({len(token_ids) + params.max_tokens} tokens) cannot fit the KV cache "
                f"of {capacity} tokens; raise kv_cache_memory"
            )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        request = EngineRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            cache_salt=cache_salt,
            lora_name=lora_name,
            skip_reading_prefix_cache=params.prompt_logprobs is not None,
            sampling_params=params,
            prompt=text,
            detokenizer=IncrementalDetokenizer(self.tokenizer),
        )
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False when it is not in flight."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request, RequestStatus.ABORTED)
        self.runner.forget(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule and run one batch; returns an output for every request that advanced."""
        step = self.scheduler.schedule()
        if not step.chunks:
            return []
        result = self.runner.execute(step)
        self.manager.index_written_sub_blocks()
        if self.kv_events is not None:  # after the forward pass: the announced blocks' K/V is written
            self.kv_events.publish_pending()
        outputs = []
        for chunk in step.chunks:
            request = chunk.request
            logprobs = result.prompt_logprobs.get(request.request_id)
            if logprobs is not None:
                request.prompt_logprobs = logprobs if chunk.start == 0 else request.prompt_logprobs + logprobs
            token = result.sampled.get(request.request_id)
            if token is None:
                continue
            outputs.append(self._append_token(request, token))
        return outputs

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """The conversation as prompt token ids, through the model's own chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def reset_prefix_cache(self) -> bool:
        reset = self.manager.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.publish_pending()
        return reset

    def close(self) -> None:
        """Release what outlives a step (the KV event publisher's thread and sockets)."""
        if self.kv_events is not None:
            self.kv_events.close()

    def stats(self) -> EngineStats:
        stats = self.manager.stats
        recent_queries = sum(q for q, _ in self._recent)
        return EngineStats(
            prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits,
            prefix_cache_copied_tokens=stats.copied_tokens,
            prefix_cache_hit_rate=stats.hit_rate,
            rolling_hit_rate=sum(h for _, h in self._recent) / recent_queries if recent_queries else 0.0,
            num_requests=stats.requests,
            num_preemptions=self.scheduler.num_preemptions,
            kv_cache_usage=self.manager.usage,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks=self.manager.num_blocks,
            block_size=self.manager.block_size,
        )

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list | tuple):
            return None, self._check_token_ids(prompt)
        raise ValueError(f"a prompt is a string, a list of token ids or a dict, not {type(prompt).__name__}")

    @staticmethod
    def _check_token_ids(token_ids: Any) -> list[int]:
        if not isinstance(token_ids, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in token_ids
        ):
            raise ValueError("prompt_token_ids must be a list of integers")
        return list(token_ids)

    def _append_token(self, request: EngineRequest, token: int) -> RequestOutput:
        now = time.monotonic()
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        request.append_output_token_ids([token])
        searched_from = len(request.text)
        request.text += request.detokenizer.decode_new(request.output_token_ids)
        self._check_stop(request, token, searched_from)
        visible = len(request.text)
        if request.finish_reason is not None:
            self._finish(request)
        else:
            visible -= request.sampling_params.stop_holdback  # may still turn into a stop string
        new_text = request.text[request.num_emitted_chars : visible]
        request.num_emitted_chars = max(request.num_emitted_chars, visible)
        return self._output(request, [token], new_text)

    def _check_stop(self, request: EngineRequest, token: int, searched_from: int) -> None:
        """Set the finish reason; a stop string cuts the text (new text is searched, with overlap)."""
        params = request.sampling_params
        if token in params.stop_token_ids:
            request.finish_reason, request.stop_reason = "stop", token
        elif token in self.eos_token_ids and not params.ignore_eos:
            request.finish_reason = "stop"
        else:
            for stop in params.stop:
                index = request.text.find(stop, max(0, searched_from - len(stop) + 1))
                if index >= 0:
                    end = index + len(stop) if params.include_stop_str_in_output else index
                    request.text = request.text[:end]
                    request.finish_reason, request.stop_reason = "stop", stop
                    return
            if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
                request.finish_reason = "length"
        if request.finish_reason is not None:
            request.text += request.detokenizer.decode_new(request.output_token_ids, final=True)

    def _finish(self, request: EngineRequest) -> None:
        self.scheduler.finish(request, RequestStatus.FINISHED)
        self.runner.forget(request.request_id)
        self.requests.pop(request.request_id, None)
        self._recent.append((request.num_prompt_tokens, request.num_cached_tokens or 0))

    @staticmethod
    def _output(request: EngineRequest, new_token_ids: list[int], new_text: str) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=request.text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.is_finished,
            num_cached_tokens=request.num_cached_tokens or 0,
            prompt_logprobs=request.prompt_logprobs,
            new_token_ids=new_token_ids,
            new_text=new_text,
        )
