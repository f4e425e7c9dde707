"""Runs one scheduled step on the model: builds the flat batch, runs the forward pass, samples.

The forward pass is the batch's: if it raises, the step fails. What follows it is per request
(prompt log-probabilities, sampling), and a failure there fails only that request (``errors``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from prefixcache.core.sub_block import CopyOp
from prefixcache.engine.sampler import Sampler
from prefixcache.engine.scheduler import ScheduledChunk, SchedulerOutput
from prefixcache.model import AttentionMetadata, DecoderForCausalLM, KVCacheGroup
from prefixcache.model.state import StateMetadata

if TYPE_CHECKING:
    from prefixcache.offload.worker import OffloadWorker

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelRunnerOutput:
    """Per request id: the sampled token and its log-probabilities, prompt log-probabilities, or an error."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[dict[int, float] | None]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


class ModelRunner:
    """Owns the paged KV cache tensors and the sampler; knows nothing of scheduling or caching policy.

    ``kv_caches`` are the model's per-layer cache tensors (``allocate_kv_cache`` for ``kv_cache_groups``); each
    chunk brings one block table per group. ``offload`` (when KV offload tiers are on) moves blocks between the
    cache tensors and the tiers around the forward pass. ``state_cache`` (a model with recurrent layers) holds
    the working states and checkpoints; each chunk then brings its state work (and an empty table for the
    recurrent-state group, last): zeroes and restores run before the forward pass, saves during it.
    """

    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: str,
        seed: int,
        kv_cache_groups: Sequence[KVCacheGroup],
        offload: OffloadWorker | None = None,
        eos_token_ids: tuple[int, ...] = (),
        state_cache: list[tuple[torch.Tensor, ...]] | None = None,
    ) -> None:
        self.model = model
        self.state_cache = state_cache
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv_caches = kv_caches
        self.kv_cache_groups = tuple(kv_cache_groups)
        self.sampler = Sampler(seed, self.device, eos_token_ids)
        self.offload = offload

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        if self.offload is not None:
            self.offload.before_forward(step.offload)
        self._copy_blocks(step.copies)
        chunks = step.chunks
        token_ids: list[int] = []
        for chunk in chunks:
            token_ids.extend(chunk.request.all_token_ids[chunk.start : chunk.start + chunk.num_new_tokens])
        num_groups = len(self.kv_cache_groups)
        num_tables = num_groups + (self.state_cache is not None)
        for chunk in chunks:
            if len(chunk.block_ids) != num_tables:
                raise ValueError(f"a chunk has {len(chunk.block_ids)} block tables for {num_tables} KV cache groups")
        starts, num_new = [c.start for c in chunks], [c.num_new_tokens for c in chunks]
        group_metadata = [
            AttentionMetadata.build(
                [c.block_ids[g] for c in chunks], starts, num_new, self.block_size, self.device, group.sliding_window
            )
            for g, group in enumerate(self.kv_cache_groups)
        ]
        metadata = group_metadata[0]  # the groups' token layout is the same: positions, rows of each request
        state_metadata = self._prepare_states(chunks) if self.state_cache is not None else None
        hidden = self.model(
            torch.tensor(token_ids, dtype=torch.long, device=self.device),
            metadata.positions,
            self.kv_caches,
            group_metadata,
            state_cache=self.state_cache,
            state_metadata=state_metadata,
        )
        if self.offload is not None:
            self.offload.after_forward(step.offload)
        out = ModelRunnerOutput()
        sampling_rows, sampling = [], []
        starts: list[int] | None = None
        for i, chunk in enumerate(chunks):
            request_id = chunk.request.request_id
            if chunk.request.sampling_params.prompt_logprobs is not None:
                starts = metadata.query_start_loc.tolist() if starts is None else starts
                try:
                    out.prompt_logprobs[request_id] = self._prompt_logprobs(hidden[starts[i] : starts[i + 1]], chunk)
                except Exception as exc:  # one request's failure is its own
                    logger.warning("prompt logprobs failed for request %s: %r", request_id, exc)
                    out.errors[request_id] = f"computing prompt logprobs failed: {exc}"
                    continue
            if chunk.samples:
                sampling_rows.append(i)
                sampling.append(chunk.request)
        if sampling:
            # A step of decodes that all sample wants every row, in order: no gather.
            every_row = metadata.decodes_only and len(sampling_rows) == len(chunks)
            logits = self.model.compute_logits(
                hidden if every_row else hidden[metadata.last_token_indices[sampling_rows]]
            )
            sampled = self.sampler.sample(logits, sampling)
            out.sampled, out.logprobs = sampled.token_ids, sampled.logprobs
            out.errors |= sampled.errors
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, chunk: ScheduledChunk) -> list[dict[int, float] | None]:
        """Log-probabilities of each next prompt token (and the top-k) at this chunk's positions."""
        request = chunk.request
        k = request.sampling_params.prompt_logprobs
        end = min(chunk.start + chunk.num_new_tokens, request.num_prompt_tokens - 1)
        count = end - chunk.start
        result: list[dict[int, float] | None] = [None] if chunk.start == 0 else []
        if count <= 0:
            return result
        logprobs = self.model.compute_logits(hidden[:count]).float().log_softmax(dim=-1)
        targets = torch.tensor(request.prompt_token_ids[chunk.start + 1 : end + 1], device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        top = logprobs.topk(k, dim=-1) if k else None
        for i, token in enumerate(targets.tolist()):
            entry = {token: chosen[i]}
            if top is not None:
                entry |= dict(zip(top.indices[i].tolist(), top.values[i].tolist(), strict=True))
            result.append(entry)
        return result

    def _prepare_states(self, chunks: list[ScheduledChunk]) -> StateMetadata:
        """Zero or restore each admitted request's working state (before any save of this step can overwrite a
        checkpoint slot), and the metadata that tells the recurrent layers their slots and saves."""
        zero, sources, targets, saves = [], [], [], []
        for row, chunk in enumerate(chunks):
            work = chunk.state
            if work is None:
                raise ValueError(f"request {chunk.request.request_id!r}: a recurrent model needs its state work")
            if work.zero:
                zero.append(work.slot)
            elif work.restore_from is not None:
                sources.append(work.restore_from)
                targets.append(work.slot)
            saves.extend((row, n, slot) for n, slot in work.saves)
        self.model.zero_states(self.state_cache, zero)
        self.model.copy_states(self.state_cache, sources, targets)
        return StateMetadata.build(
            [chunk.state.slot for chunk in chunks], [chunk.num_new_tokens for chunk in chunks], saves, self.device
        )

    def _copy_blocks(self, copies: list[CopyOp]) -> None:
        """Sub-block hits: the first tokens of a shared block into the request's own block, every layer."""
        for op in copies:
            for key_cache, value_cache in self.kv_caches:
                key_cache[op.dst, : op.num_tokens] = key_cache[op.src, : op.num_tokens]
                value_cache[op.dst, : op.num_tokens] = value_cache[op.src, : op.num_tokens]

    def forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)
