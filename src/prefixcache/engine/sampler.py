"""Turns the last-position logits of each sampling request into its next token (and its log-probabilities)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.model.native import native_ops

logger = logging.getLogger(__name__)

# What prefixcache's argmax kernel reads (the decoder's other dtypes take torch's op).
_ARGMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class SamplingRequest(Protocol):
    """What the sampler reads of a request (``EngineRequest`` is one)."""

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass(slots=True)
class SamplerOutput:
    """Per request id: the sampled token, its ``{token id: log-probability}`` if asked, or why it failed."""

    token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


class Sampler:
    """Greedy rows without penalties are one batched argmax; the rest are sampled row by row.

    Sampling happens after the batch's forward pass and is independent per request, so a row that raises
    fails only its own request (it lands in ``errors``); the other rows are sampled as if it were not there.
    A request with a ``seed`` draws from its own generator, so its tokens do not depend on what else is in
    the batch. Log-probabilities are the model's raw distribution (log-softmax of the logits, before
    penalties, temperature and top-k/top-p), as vLLM returns by default. ``eos_token_ids`` are the model's,
    banned (with the stop token ids) while a request has fewer than its ``min_tokens``.
    """

    def __init__(self, seed: int, device: torch.device, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> SamplerOutput:
        """``logits`` ``[len(requests), vocab]`` in the model's dtype: the plain greedy rows are read as they are
        (one batched argmax), and only the rows that need float32 values are converted (log-probabilities,
        penalties, banned tokens, drawing)."""
        out = SamplerOutput()
        banned = [r.sampling_params.banned_token_ids(len(r.output_token_ids), self.eos_token_ids) for r in requests]
        plain = [
            row
            for row, r in enumerate(requests)
            if r.sampling_params.greedy and not r.sampling_params.has_penalties and not banned[row]
        ]
        greedy = greedy_tokens(logits if len(plain) == len(requests) else logits[plain]) if plain else []
        tokens = dict(zip(plain, greedy, strict=True))
        float_rows = [
            row for row, r in enumerate(requests) if row not in tokens or r.sampling_params.logprobs is not None
        ]
        # a copy (an index with a list gathers), so a row's penalties and bans may change it in place; none where
        # every row is plain greedy (an empty index still costs a gather call, ~20 us a step)
        floats = dict(zip(float_rows, logits[float_rows].float(), strict=True)) if float_rows else {}
        logprob_rows = [row for row, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        raw = torch.stack([floats[row] for row in logprob_rows]).log_softmax(dim=-1) if logprob_rows else []
        raw_logprobs = dict(zip(logprob_rows, raw, strict=True))
        for row, request in enumerate(requests):
            p = request.sampling_params
            try:
                token = tokens.get(row)
                if token is None:
                    row_logits = floats[row]
                    if p.has_penalties:
                        _apply_penalties(row_logits, request)
                    if banned[row]:
                        row_logits[[t for t in banned[row] if t < row_logits.numel()]] = float("-inf")
                    if p.greedy:
                        token = greedy_tokens(row_logits[None])[0]
                    else:
                        token = self._draw(row_logits, p, self._generator_for(request.request_id, p))
                if p.logprobs is not None:
                    out.logprobs[request.request_id] = _token_logprobs(raw_logprobs[row], token, p.logprobs)
            except Exception as exc:  # whatever one request's values do, only that request fails
                logger.warning("sampling failed for request %s: %r", request.request_id, exc)
                out.errors[request.request_id] = f"sampling failed: {exc}"
            else:
                out.token_ids[request.request_id] = token
        return out

    def forget(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)

    def _generator_for(self, request_id: str, p: SamplingParams) -> torch.Generator:
        if p.seed is None:
            return self.generator
        generator = self.request_generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(p.seed)
            self.request_generators[request_id] = generator
        return generator

    @staticmethod
    def _draw(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
        return int(torch.multinomial(distribution(logits, p), 1, generator=generator)[0])


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax as ``argmax`` picks it (the first of equal maxima; a NaN above any number), read in the
    logits' own dtype: bfloat16 rows need no float32 copy, whose conversion and argmax cost more than the pick.

    On CPU it is prefixcache's ``argmax_rows`` kernel (the sampler runs after the compiled step, never inside one,
    so the op needs no fake impl); elsewhere torch's ``max``, whose index is documented as the first maximum too
    and which is several times faster than ``argmax`` on CPU.
    """
    ops = native_ops() if logits.device.type == "cpu" and logits.dtype in _ARGMAX_DTYPES else None
    if ops is not None:
        return ops.argmax_rows(logits).tolist()
    return logits.max(dim=-1).indices.tolist()


def distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The probabilities a non-greedy row is drawn from, in vLLM's order: temperature, min-p, top-k, top-p."""
    logits = logits / p.temperature
    if p.min_p > 0:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if 0 < p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - sorted_logits.softmax(dim=-1) >= p.top_p  # keep the smallest set reaching top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(dim=-1)


def _apply_penalties(logits: torch.Tensor, request: SamplingRequest) -> torch.Tensor:
    """vLLM's penalties, in place on one row: repetition over prompt and output, the others over the output."""
    p = request.sampling_params
    if p.repetition_penalty != 1.0:
        seen_ids = sorted({*request.prompt_token_ids, *request.output_token_ids})
        seen = torch.tensor(seen_ids, dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and request.output_token_ids:
        generated = torch.tensor(request.output_token_ids, dtype=torch.long, device=logits.device)
        ids, counts = generated.unique(return_counts=True)
        logits[ids] -= p.frequency_penalty * counts + p.presence_penalty
    return logits


def _token_logprobs(logprobs: torch.Tensor, token: int, k: int) -> dict[int, float]:
    """The sampled token's log-probability first, then the top-k (which may include it)."""
    entry = {token: float(logprobs[token])}
    if k:
        top = logprobs.topk(min(k, logprobs.numel()))
        entry |= dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return entry
