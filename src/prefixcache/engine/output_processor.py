"""Output processing: the core's token deltas in, ``RequestOutput``s with text out.

Detokenizes incrementally, applies stop strings (a match ends the request here and asks the caller to
abort it in the core) and holds back text that could still turn into a stop string. Runs on the API
side, so the core never spends a step on text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefixcache.engine.detokenizer import IncrementalDetokenizer
from prefixcache.engine.messages import EngineCoreOutput, EngineCoreRequest
from prefixcache.engine.outputs import CompletionOutput, RequestOutput
from prefixcache.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_emitted_chars: int = 0
    stop_search_start: int = 0  # a stop string must end after the text of the first min_tokens tokens
    prompt_logprobs: list[dict[int, float] | None] | None = None
    logprobs: list[dict[int, float]] | None = None
    stop_holdback: int = 0  # the params' (frozen), not worked out again each step


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add_request(self, request: EngineCoreRequest, prompt: str | None) -> None:
        self._states[request.request_id] = _RequestState(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            params=request.sampling_params,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer,
                request.sampling_params.skip_special_tokens,
                request.sampling_params.spaces_between_special_tokens,
            ),
            logprobs=None if request.sampling_params.logprobs is None else [],
            stop_holdback=request.sampling_params.stop_holdback,
        )

    def abort_request(self, request_id: str) -> bool:
        """Forget a request; False when it was not in flight."""
        return self._states.pop(request_id, None) is not None

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """The request outputs, and the ids that a stop string finished (still running in the core).

        Outputs of requests no longer tracked (aborted meanwhile) are dropped.
        """
        results: list[RequestOutput] = []
        stopped: list[str] = []
        for output in outputs:
            state = self._states.get(output.request_id)
            if state is None:
                continue
            finish_reason, stop_reason = self._advance(state, output)
            if finish_reason is not None:
                del self._states[output.request_id]
                if output.finish_reason is None:
                    stopped.append(output.request_id)
            results.append(_request_output(state, output, finish_reason, stop_reason))
        return results, stopped

    @staticmethod
    def _advance(state: _RequestState, output: EngineCoreOutput) -> tuple[str | None, int | str | None]:
        """Append the new tokens and text; a stop string beats ``length`` but not a stop token or EOS, and
        none counts within the first ``min_tokens`` tokens. The stop token itself shows in the text only with
        ``include_stop_str_in_output`` (it stays in the token ids)."""
        if output.prompt_logprobs is not None:
            state.prompt_logprobs = output.prompt_logprobs
        state.output_token_ids.extend(output.new_token_ids)
        if state.logprobs is not None and output.logprobs is not None:
            state.logprobs.extend(output.logprobs)
        finish_reason, stop_reason = output.finish_reason, output.stop_reason
        params = state.params
        shown = state.output_token_ids
        if finish_reason == "stop" and not params.include_stop_str_in_output:
            shown = shown[:-1]  # vLLM: the token that stopped it (EOS or a stop token id) is not in the text
        searched_from = max(len(state.text), state.stop_search_start)
        state.text += state.detokenizer.decode_new(shown)
        if len(state.output_token_ids) <= params.min_tokens:  # vLLM: no stop string ends the first min_tokens
            state.stop_search_start = len(state.text)
        elif finish_reason in (None, "length"):
            for stop in params.stop:
                index = state.text.find(stop, max(0, searched_from - len(stop) + 1))
                if index >= 0:
                    end = index + len(stop) if params.include_stop_str_in_output else index
                    state.text = state.text[:end]
                    finish_reason, stop_reason = "stop", stop
                    break
        if finish_reason is not None:
            if stop_reason is None or isinstance(stop_reason, int):  # a stop string already cut the text
                state.text += state.detokenizer.decode_new(shown, final=True)
            return finish_reason, stop_reason
        return None, None


def _request_output(
    state: _RequestState, output: EngineCoreOutput, finish_reason: str | None, stop_reason: int | str | None
) -> RequestOutput:
    visible = len(state.text)
    if finish_reason is None:
        visible -= state.stop_holdback  # may still turn into a stop string
    new_text = state.text[state.num_emitted_chars : visible]
    state.num_emitted_chars = max(state.num_emitted_chars, visible)
    completion = CompletionOutput(
        index=0,
        text=state.text,
        token_ids=list(state.output_token_ids),
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        logprobs=None if state.logprobs is None else list(state.logprobs),
        error=output.error,
    )
    return RequestOutput(
        request_id=state.request_id,
        prompt=state.prompt,
        prompt_token_ids=state.prompt_token_ids,
        outputs=[completion],
        finished=finish_reason is not None,
        num_cached_tokens=output.num_cached_tokens,
        prompt_logprobs=state.prompt_logprobs,
        new_token_ids=list(output.new_token_ids),
        new_text=new_text,
        num_retained_written_tokens=output.num_retained_written_tokens,
        num_retained_written_tokens_by_ttl=output.num_retained_written_tokens_by_ttl,
        num_retained_read_tokens=output.num_retained_read_tokens,
        retention_clamped=output.retention_clamped,
    )
