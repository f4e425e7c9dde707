"""The offline API, shaped like vLLM's ``LLM`` so users can switch with few changes."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from prefixcache.config import EngineConfig
from prefixcache.core import PrefixLookup
from prefixcache.core.retention import RetentionRange
from prefixcache.engine.llm_engine import EngineStats, LLMEngine, PromptInput
from prefixcache.engine.outputs import RequestOutput
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.model import LoadedModel

Messages = list[dict[str, Any]]


class LLM:
    """Generate for a list of prompts, batching them all through one engine.

    ``LLM(model=None)`` loads the default model, SmolLM2-135M-Instruct. Keyword arguments are the
    fields of :class:`~prefixcache.config.EngineConfig` (or pass ``config``, one already built);
    ``loaded`` reuses weights already in memory (benchmarks build several engines on one model), which
    must be in the config's dtype.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        loaded: LoadedModel | None = None,
        config: EngineConfig | None = None,
        **kwargs: Any,
    ) -> None:
        if config is not None and (model is not None or kwargs):
            raise ValueError("pass either config or engine settings (model and keyword arguments), not both")
        self.engine = LLMEngine(config or EngineConfig(model=model, **kwargs), loaded)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        cache_salt: str | None = None,
        retention: Sequence[RetentionRange] | Sequence[Sequence[RetentionRange]] = (),
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. Every prompt is validated before any runs.

        ``retention`` asks the cache to keep token ranges of the prompts at a priority for a TTL: one list of
        ``RetentionRange`` for every prompt, or a list of them, one per prompt (as ``sampling_params``)."""
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if retention and not isinstance(retention[0], RetentionRange):
            directives = [tuple(r) for r in retention]
            if len(directives) != len(prompts):
                raise ValueError(f"{len(directives)} retention lists for {len(prompts)} prompts")
        else:
            directives = [tuple(retention)] * len(prompts)
        request_ids: list[str] = []
        try:
            for prompt, p, r in zip(prompts, params, directives, strict=True):
                request_ids.append(self.engine.add_request(prompt, p, cache_salt=cache_salt, retention=r))
        except ValueError:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        add_generation_prompt: bool = True,
        cache_salt: str | None = None,
        retention: Sequence[RetentionRange] | Sequence[Sequence[RetentionRange]] = (),
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate (``retention`` as there). On a
        model with recurrent layers each message's end is a checkpoint hint, so a later conversation sharing
        the first messages hits them all."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.chat_prompt(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, cache_salt=cache_salt, retention=retention)

    def apply_chat_template(self, messages: Messages, add_generation_prompt: bool = True) -> list[int]:
        return self.engine.apply_chat_template(messages, add_generation_prompt)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def lookup(self, prompt: PromptInput, cache_salt: str | None = None) -> PrefixLookup:
        """How many of the prompt's tokens are cached now (on the device and in each offload tier), where the
        cached prefix ends and why the rest would miss. Runs no model and changes nothing: the eviction order
        stays as it was."""
        return self.engine.lookup(prompt, cache_salt)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _run(self, request_ids: list[str], use_tqdm: bool | Callable[..., tqdm]) -> list[RequestOutput]:
        """Step until every request finished. The bar counts tokens (prompt tokens computed or read from the
        cache, then output tokens), so it moves during a long prefill and its ETA follows the real work; a
        request that ends before ``max_tokens`` counts as done. ``use_tqdm`` may be a tqdm factory (as in vLLM, say
        ``functools.partial(tqdm, desc="run 1")``)."""
        finished: dict[str, RequestOutput] = {}
        totals = {i: self.engine.progress(i)[1] for i in request_ids}
        pending = set(request_ids)
        done_tokens = 0
        make_bar = use_tqdm if callable(use_tqdm) else functools.partial(tqdm, desc="generate", disable=not use_tqdm)
        with make_bar(total=sum(totals.values()), unit="tok", unit_scale=True) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished and output.request_id in pending:
                        finished[output.request_id] = output
                        pending.discard(output.request_id)
                        done_tokens += totals[output.request_id]
                if use_tqdm:
                    in_flight = sum(self.engine.progress(i)[0] for i in pending)
                    bar.set_postfix_str(f"{len(finished)}/{len(request_ids)} requests", refresh=False)
                    bar.update(max(0, done_tokens + in_flight - bar.n))  # a preempted request recomputes
        return [finished[i] for i in request_ids]
