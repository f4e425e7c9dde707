"""The engine core: scheduler, KV cache manager and model runner, on token ids only.

``EngineCore`` knows nothing of text or HTTP. It takes ``EngineCoreRequest``s, runs one batch per
``step()`` and returns only what is new: each request's new token ids, its finish reason when a token
ends it (EOS, a stop token id, ``max_tokens``, the context length), its cache hit, and the stats after
the step. Stop strings are the output processor's job: it aborts the core request when one matches.
The offline ``LLM`` calls it in process; ``prefixcache serve`` runs it in its own process
(``engine/core_process.py``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import torch

from prefixcache.config import EngineConfig
from prefixcache.core import KVCacheManager, PrefixLookup
from prefixcache.core.hashing import resolve_hash_seed, root_hash
from prefixcache.core.kv_cache_groups import check_sub_blocks
from prefixcache.engine.cache_layout import cache_layout
from prefixcache.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineInfo, EngineStats
from prefixcache.engine.model_runner import ModelRunner
from prefixcache.engine.request import EngineRequest, RequestStatus
from prefixcache.engine.scheduler import Scheduler
from prefixcache.kv_events.sink import KVEventSink
from prefixcache.model import LoadedModel, load_model
from prefixcache.offload.engine import build_offload
from prefixcache.offload.worker import OffloadWorker

logger = logging.getLogger(__name__)

ROLLING_WINDOW = 1000


def load_engine_model(config: EngineConfig) -> LoadedModel:
    """The model ``config`` names, in its dtype, on its device, quantized as it asks."""
    return load_model(config.model, dtype=config.dtype, device=config.device, quantized=config.quantization == "gguf")


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        _check_device(config.device)  # before minutes of loading, in words that name the flag
        self.loaded = loaded or load_engine_model(config)
        weights_dtype = str(next(self.loaded.model.parameters()).dtype).removeprefix("torch.")
        if weights_dtype != config.dtype:
            raise ValueError(
                f"the loaded model is {weights_dtype} but the engine runs {config.dtype} ({config.dtype_reason}): "
                f"pass dtype={weights_dtype!r} or load the model in {config.dtype}"
            )
        if self.loaded.quantized != (config.quantization == "gguf"):
            raise ValueError(
                f"the loaded model's weights are {'quantized' if self.loaded.quantized else 'floats'} but the engine "
                f"runs quantization={config.quantization!r}"
            )
        model_config = self.loaded.config
        self.vocab_size = model_config.vocab_size
        layout = cache_layout(config, model_config)
        self.max_model_len = layout.max_model_len
        enable_caching = layout.enable_caching
        if config.enable_prefix_caching and not enable_caching:
            logger.warning("prefix caching turned off: %s attention is not causal", model_config.architecture)
        dtype = getattr(torch, config.dtype)
        model = self.loaded.model
        model_groups, groups, num_blocks = layout.model_groups, layout.groups, layout.num_blocks
        self.block_bytes = layout.block_bytes
        self.state_slot_bytes = layout.state_slot_bytes
        self.state_bytes = layout.state_bytes
        check_sub_blocks(groups, config.block_size, config.sub_block_size)  # before any tier starts
        self.kv_events = KVEventSink.create(config.kv_events_config, groups)
        listeners = [self.kv_events.collector] if self.kv_events is not None else []
        root = root_hash(config.hash_algo, config.hash_seed)
        tiers = build_offload(
            self,
            config,
            model_config,
            self.loaded.weights_digest,
            root,
            groups,
            enable_caching,
            listeners,
            self.state_slot_bytes,
        )
        self.offload = tiers.connector if tiers is not None else None
        self.manager = KVCacheManager(
            num_blocks=num_blocks,
            block_size=config.block_size,
            enable_caching=enable_caching,
            hash_algo=config.hash_algo,
            hash_seed=config.hash_seed,
            eviction_policy=config.eviction_policy,
            sub_block_size=config.sub_block_size,
            groups=groups,
            connector=self.offload,
            listeners=listeners,
            max_retained_fraction=config.max_retained_fraction,
            max_retention_ttl_s=config.max_retention_ttl_s,
            max_tenant_retained_fraction=config.max_tenant_retained_fraction,
            num_state_slots=layout.num_state_slots,
            num_checkpoint_slots=layout.num_checkpoint_slots,
            checkpoint_policy=layout.checkpoint_policy(config.block_size),
            retention_rule=config.retention_rule,
        )
        self.kv_capacity_tokens = self.manager.max_request_tokens(config.max_num_batched_tokens)
        if config.max_model_len is not None and config.max_model_len > self.kv_capacity_tokens:
            logger.warning(
                "max_model_len %d (--max-model-len) is more than the KV cache can ever hold for one request (%d "
                "tokens): longer requests are refused, and a request without max_tokens may grow to %d tokens; "
                "raise --kv-cache-memory (or --num-gpu-blocks-override) or lower --max-model-len",
                config.max_model_len,
                self.kv_capacity_tokens,
                self.kv_capacity_tokens,
            )
        self.scheduler = Scheduler(
            self.manager, config.max_num_seqs, config.max_num_batched_tokens, config.scheduling_policy
        )
        device = torch.device(config.device)
        kv_caches = model.allocate_kv_cache(num_blocks, config.block_size, dtype, device, model_groups)
        state_cache = None
        if self.manager.state is not None:
            state_cache = model.allocate_state_cache(self.manager.state.num_slots, dtype, device)
        # Seconds the decode step took to compile at start-up; None: it runs eagerly.
        self.decode_compile_s = None
        if config.enforce_eager:
            packed = model.pack_linears()
            if packed:
                logger.info("%d linear layers run on weights laid out for this CPU's kernels", packed)
        else:
            self.decode_compile_s = model.compile_decode(kv_caches, model_groups, config.block_size)
            if self.decode_compile_s is not None:
                logger.info("decode step compiled in %.1f s (torch.compile)", self.decode_compile_s)
        worker = None
        if tiers is not None:
            # The KV cache group of each attention layer, in the order of the KV cache tensors.
            position = {layer: i for i, layer in enumerate(model_config.attention_layers)}
            layer_groups = [0] * len(position)
            for g, group in enumerate(model_groups):
                for layer in group.layers:
                    layer_groups[position[layer]] = g
            worker = OffloadWorker(kv_caches, tiers.layout, tiers.writer, layer_groups, state_cache)
        self.runner = ModelRunner(
            model,
            kv_caches,
            config.block_size,
            config.device,
            config.seed,
            model_groups,
            worker,
            eos_token_ids=tuple(model_config.eos_token_ids),
            state_cache=state_cache,
        )
        self.requests: dict[str, EngineRequest] = {}
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self._recent: deque[tuple[int, int]] = deque(maxlen=ROLLING_WINDOW)
        logger.info(
            "engine: %s on %s in %s (%s); KV cache: %d blocks of %d tokens, %d KV cache group(s) (%s), "
            "requests up to %d tokens, prefix caching %s",
            self.loaded.name,
            config.device,
            config.dtype,
            config.dtype_reason,
            num_blocks,
            config.block_size,
            len(groups),
            ", ".join(spec.describe() for spec in groups),
            self.kv_capacity_tokens,
            "on" if enable_caching else "off",
        )

    def info(self) -> EngineInfo:
        return EngineInfo(
            model_name=self.loaded.name,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            block_size=self.manager.block_size,
            num_blocks=self.manager.num_blocks,
            hash_algo=self.manager.hash_algo,
            hash_seed=resolve_hash_seed(self.config.hash_seed),
            enable_prefix_caching=self.manager.enable_caching,
            kv_capacity_tokens=self.kv_capacity_tokens,
            architecture=self.loaded.config.architecture,
            dtype=str(self.runner.kv_caches[0][0].dtype).removeprefix("torch."),
            device=str(self.runner.device),
            # Layer views share storage per group slot; recurrent states (working and checkpoints) beside.
            kv_cache_bytes=self.manager.num_blocks * self.block_bytes + self.state_bytes,
            kv_cache_groups=self.manager.groups,
            **self._state_budget(),
        )

    def _state_budget(self) -> dict[str, int]:
        """The recurrent-state group's slots and sparse interval (none without recurrent layers)."""
        state = self.manager.state
        if state is None:
            return {}
        return {
            "num_state_slots": state.num_working_slots,
            "num_checkpoint_slots": state.num_checkpoint_slots,
            "sparse_every_blocks": state.policy.sparse_every_blocks,
        }

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the input processor validated; raises ValueError if it still cannot run here."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        token_ids = request.prompt_token_ids
        if not token_ids or min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ValueError(f"request {request.request_id!r}: prompt token ids must be in [0, {self.vocab_size})")
        # The last token sampled is never computed: it takes no position and no KV slot (so a prompt-only echo of
        # a whole context runs; the input processor holds other requests to vLLM's prompt plus max_tokens).
        total = len(token_ids) + request.sampling_params.max_tokens - 1
        if total > min(self.max_model_len, self.kv_capacity_tokens):
            raise ValueError(f"request {request.request_id!r}: {total} tokens do not fit the context or KV cache")
        params = request.sampling_params
        engine_request = EngineRequest(
            request_id=request.request_id,
            prompt_token_ids=token_ids,
            cache_salt=request.cache_salt,
            lora_name=request.lora_name,
            retention=request.retention,
            tenant=request.tenant,
            checkpoint_hints=request.checkpoint_hints,
            skip_reading_prefix_cache=params.prompt_logprobs is not None,
            sampling_params=params,
        )
        self.requests[request.request_id] = engine_request
        self.scheduler.add_request(engine_request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop requests and free their blocks; ids not in flight are ignored (they may have just finished)."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, RequestStatus.ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> EngineCoreOutputs:
        """Schedule and run one batch; an output for every request that sampled a token."""
        step = self.scheduler.schedule()
        outputs: list[EngineCoreOutput] = []
        if step.chunks:
            result = self.runner.execute(step)
            self.manager.index_written_sub_blocks()
            if self.kv_events is not None:  # after the forward pass: the announced blocks' K/V is written
                self.kv_events.publish_pending()
            for chunk in step.chunks:
                request = chunk.request
                error = result.errors.get(request.request_id)
                if error is not None:
                    outputs.append(self._fail(request, error))
                    continue
                logprobs = result.prompt_logprobs.get(request.request_id)
                if logprobs is not None:
                    request.prompt_logprobs = logprobs if chunk.start == 0 else request.prompt_logprobs + logprobs
                token = result.sampled.get(request.request_id)
                if token is not None:
                    outputs.append(self._append_token(request, token, result.logprobs.get(request.request_id)))
        return self.outputs(outputs)

    def outputs(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        """A batch of outputs stamped with the time and the stats as they are now."""
        return EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic(), stats=self.stats())

    def reset_prefix_cache(self) -> bool:
        reset = self.manager.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.publish_pending()
        return reset

    def close(self) -> None:
        """Release what outlives a step: the event publisher's thread and sockets, the offload tiers' writer."""
        if self.kv_events is not None:
            self.kv_events.close()
        if self.offload is not None:
            self.offload.close()

    def lookup(self, token_ids: list[int], cache_salt: str | None = None, lora_name: str | None = None) -> PrefixLookup:
        """What the cache and the offload tiers hold of these (validated) prompt tokens now; runs no model and
        changes nothing."""
        return self.manager.lookup(token_ids, cache_salt=cache_salt, lora_name=lora_name)

    def stats(self) -> EngineStats:
        stats = self.manager.stats
        pool = self.manager.pool
        counters = pool.retention_counters
        recent_queries = sum(q for q, _ in self._recent)
        checkpoints = self.manager.state.stats if self.manager.state is not None else None
        return EngineStats(
            prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits,
            prefix_cache_copied_tokens=stats.copied_tokens,
            prefix_cache_missed_tokens=dict(stats.missed_tokens),
            prefix_cache_hit_rate=stats.hit_rate,
            prefix_cache_preempted_queries=stats.preempted_queries,
            prefix_cache_preempted_hits=stats.preempted_hits,
            rolling_hit_rate=sum(h for _, h in self._recent) / recent_queries if recent_queries else 0.0,
            num_requests=stats.requests,
            num_preemptions=self.scheduler.num_preemptions,
            kv_cache_usage=self.manager.usage,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks=self.manager.num_blocks,
            block_size=self.manager.block_size,
            kv_offload=self.offload.stats() if self.offload is not None else [],
            kv_events_dropped=self.kv_events.num_dropped if self.kv_events is not None else 0,
            prefix_cache_retained_read_tokens=stats.retained_read_tokens,
            prefix_cache_retained_written_tokens=stats.retained_written_tokens,
            kv_cache_block_hits=dict(counters.hits),
            kv_cache_block_evictions=dict(counters.evictions),
            kv_cache_block_expirations=dict(counters.expirations),
            retained_blocks_by_tenant=pool.retained_blocks_by_tenant(),
            state_checkpoints_saved=sum(checkpoints.saved.values()) if checkpoints else 0,
            state_checkpoint_hits=sum(checkpoints.hits.values()) if checkpoints else 0,
            state_checkpoints_evicted=sum(checkpoints.evicted.values()) if checkpoints else 0,
        )

    def _fail(self, request: EngineRequest, error: str) -> EngineCoreOutput:
        """End one request that failed on its own (its blocks hold valid K/V: the forward pass succeeded)."""
        self._finish(request, RequestStatus.ABORTED)
        return EngineCoreOutput(
            request.request_id,
            [],
            request.num_cached_tokens or 0,
            finish_reason="abort",
            error=error,
            **_retention_accounting(request),
        )

    def _append_token(
        self, request: EngineRequest, token: int, logprobs: dict[int, float] | None = None
    ) -> EngineCoreOutput:
        """Add the sampled token and decide, on tokens alone, whether it ends the request."""
        first = request.num_output_tokens == 0
        request.append_output_token_ids([token])
        params = request.sampling_params
        finish_reason, stop_reason = None, None
        if token in params.stop_token_ids:
            finish_reason, stop_reason = "stop", token
        elif token in self.eos_token_ids and not params.ignore_eos:
            finish_reason = "stop"
        elif request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            finish_reason = "length"
        output = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[token],
            num_cached_tokens=request.num_cached_tokens or 0,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            prompt_logprobs=request.prompt_logprobs if first else None,
            logprobs=None if logprobs is None else [logprobs],
            **_retention_accounting(request),
        )
        if finish_reason is not None:
            self._finish(request, RequestStatus.FINISHED)
        return output

    def _finish(self, request: EngineRequest, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)
        self.runner.forget(request.request_id)
        del self.requests[request.request_id]
        if request.num_cached_tokens is not None:  # it was admitted, so its lookup counts
            self._recent.append((request.num_prompt_tokens, request.num_cached_tokens))


def _retention_accounting(request: EngineRequest) -> dict[str, Any]:
    """The retention fields of a request's output: retained tokens read and written, and the bounds hit."""
    return {
        "num_retained_written_tokens": request.num_retained_written_tokens,
        "num_retained_written_tokens_by_ttl": dict(request.num_retained_written_tokens_by_ttl),  # as of now
        "num_retained_read_tokens": request.num_retained_read_tokens,
        "retention_clamped": ", ".join(request.retention_clamped) or None,
    }


def _check_device(device: str) -> None:
    """ValueError for a device torch cannot use here (a GPU on a CPU-only build, a name torch does not know)."""
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as exc:
        raise ValueError(f"device {device!r} (--device) cannot be used here: {exc}") from exc
