"""The core's messages survive msgpack unchanged, and a malformed one is refused, not half-read."""

import msgspec
import pytest

from prefixcache.core.retention import RetentionRange
from prefixcache.engine.messages import (
    AbortRequests,
    EngineCoreFailure,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    EngineStats,
    Shutdown,
    UtilityCall,
    UtilityResult,
    encoder,
    input_decoder,
    output_decoder,
)
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.offload.store import TierStats

STATS = EngineStats(
    100,
    40,
    4,
    {"new": 50, "evicted": 6, "partial_block": 4, "skipped": 0, "no_checkpoint": 0},
    0.4,
    0.5,
    3,
    1,
    0.25,
    2,
    1,
    64,
    16,
    [TierStats("CPU", 2**20, hits=3, hit_tokens=48, load_seconds=0.5)],
)
INPUTS = [
    EngineCoreRequest(
        "req-1",
        [1, 2, 3],
        SamplingParams(max_tokens=5, temperature=0.5, top_k=3, seed=7, stop=("\n", "END"), stop_token_ids=(9,)),
        cache_salt="tenant",
        lora_name="adapter",
    ),
    EngineCoreRequest("req-2", [4], SamplingParams(prompt_logprobs=2)),
    EngineCoreRequest(
        "req-3",
        [4],
        SamplingParams(seed=2**64 - 1, logprobs=5, presence_penalty=-2, frequency_penalty=0.5, repetition_penalty=1.2),
    ),
    EngineCoreRequest("req-4", [4], SamplingParams(seed=-(2**63))),
    EngineCoreRequest(
        "req-5",
        list(range(40)),
        SamplingParams(),
        retention=(RetentionRange(0, 32, priority=90, ttl_s=3600.0), RetentionRange(32, priority=10)),
        tenant="acme",
        checkpoint_hints=(16, 37),
    ),
    AbortRequests(["req-1", "req-2"]),
    UtilityCall(3, "reset_prefix_cache"),
    Shutdown(),
]
OUTPUTS = [
    EngineCoreOutputs(
        [
            EngineCoreOutput("req-1", [42], 16, prompt_logprobs=[None, {5: -0.25, 6: -1.5}]),
            EngineCoreOutput("req-2", [2], 0, finish_reason="stop", stop_reason=2),
            EngineCoreOutput("req-3", [8], 4, finish_reason="length", logprobs=[{8: -0.5, 3: -0.25}]),
            EngineCoreOutput("req-4", [], 0, finish_reason="abort", error="sampling failed: boom"),
            EngineCoreOutput(
                "req-5", [3], 32, num_retained_written_tokens=16, num_retained_read_tokens=32, retention_clamped="ttl"
            ),
        ],
        timestamp=12.5,
        stats=STATS,
    ),
    UtilityResult(3, result=True),
    UtilityResult(4, error="unknown engine core method 'x'"),
    EngineCoreFailure("the engine core failed: RuntimeError('boom')"),
    EngineInfo("tiny", 1024, 512, 16, 64, "sha256", "prefixcache", True, 1024),
]


@pytest.mark.parametrize("message", INPUTS, ids=lambda m: type(m).__name__)
def test_inputs_round_trip(message):
    assert input_decoder.decode(encoder.encode(message)) == message


@pytest.mark.parametrize("message", OUTPUTS, ids=lambda m: type(m).__name__)
def test_outputs_round_trip(message):
    assert output_decoder.decode(encoder.encode(message)) == message


def test_stats_returned_by_a_utility_call_convert_back():
    result = output_decoder.decode(encoder.encode(UtilityResult(1, result=STATS)))
    assert msgspec.convert(result.result, EngineStats) == STATS


def test_invalid_sampling_params_are_refused_on_decode():
    raw = msgspec.msgpack.encode(["EngineCoreRequest", "r", [1], {"max_tokens": 0}, None, None])
    with pytest.raises(msgspec.ValidationError, match="max_tokens"):
        input_decoder.decode(raw)


def test_an_output_message_is_not_accepted_as_input():
    with pytest.raises(msgspec.ValidationError):
        input_decoder.decode(encoder.encode(OUTPUTS[0]))


def test_a_retention_directive_out_of_range_is_refused_on_decode():
    request = EngineCoreRequest("r", [1, 2], SamplingParams(), retention=(RetentionRange(0, priority=90),))
    raw = msgspec.msgpack.encode(msgspec.to_builtins(request))
    assert input_decoder.decode(raw) == request
    bad = msgspec.to_builtins(request)
    bad[6][0]["priority"] = 101
    with pytest.raises(msgspec.ValidationError, match="priority"):
        input_decoder.decode(msgspec.msgpack.encode(bad))
