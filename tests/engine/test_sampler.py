"""The sampler: penalties as vLLM defines them, raw log-probabilities, and one request's failure kept to itself."""

import dataclasses
import math
from dataclasses import dataclass, field

import pytest
import torch

from prefixcache.engine import SamplingParams
from prefixcache.engine.sampler import Sampler

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@dataclass
class Row:
    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)


def greedy_pick(logits: list[float], **kwargs) -> int:
    row = Row("r", SamplingParams(temperature=0.0, **{k: v for k, v in kwargs.items() if "token_ids" not in k}))
    row.prompt_token_ids = kwargs.get("prompt_token_ids", [])
    row.output_token_ids = kwargs.get("output_token_ids", [])
    return Sampler(0, torch.device("cpu")).sample(torch.tensor([logits]), [row]).token_ids["r"]


def poisoned(params: SamplingParams) -> SamplingParams:
    """Params whose temperature is NaN, as if validation had missed it: sampling them raises in torch."""
    object.__setattr__(params, "temperature", math.nan)
    return params


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    # token 0 seen in the prompt: 3.0 / 4 = 0.75 falls below token 1's 2.0
    assert greedy_pick([3.0, 2.0, 1.0], repetition_penalty=4.0, prompt_token_ids=[0]) == 1
    assert greedy_pick([3.0, 2.0, 1.0], repetition_penalty=1.4, prompt_token_ids=[0]) == 0
    # token 0 seen in the output: -0.5 * 4 = -2.0 falls below token 1's -1.0
    assert greedy_pick([-0.5, -1.0, -3.0], repetition_penalty=4.0, output_token_ids=[0]) == 1
    # below 1 it favours seen tokens
    assert greedy_pick([1.0, 2.0, 0.0], repetition_penalty=0.25, prompt_token_ids=[0]) == 0


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    output = {"output_token_ids": [0, 0, 2]}
    assert greedy_pick([2.0, 1.5, 1.0], frequency_penalty=0.3, **output) == 1  # 2.0 - 2 * 0.3 = 1.4
    assert greedy_pick([2.0, 1.5, 1.0], frequency_penalty=0.2, **output) == 0  # 1.6
    assert greedy_pick([2.0, 1.5, 1.0], presence_penalty=0.6, **output) == 1  # 1.4, once however often
    assert greedy_pick([2.0, 1.5, 1.0], presence_penalty=0.4, **output) == 0  # 1.6
    assert greedy_pick([2.0, 1.5, 1.0], frequency_penalty=2.0, prompt_token_ids=[0, 0, 0]) == 0  # prompt: no
    assert greedy_pick([1.0, 1.2], presence_penalty=-0.5, output_token_ids=[0]) == 0  # negative encourages


def test_logprobs_are_the_raw_distribution_with_the_sampled_token_first():
    logits = torch.tensor([[0.5, 3.0, 2.5, -1.0, 1.0, 0.0]])
    raw = logits[0].log_softmax(-1)
    penalized = Row("p", SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=2), output_token_ids=[1])
    sampled = Row("s", SamplingParams(temperature=0.3, top_k=2, seed=1, logprobs=0))
    out = Sampler(0, torch.device("cpu")).sample(logits.repeat(2, 1), [penalized, sampled])
    assert out.token_ids["p"] == 2  # the penalty moved the choice off the raw argmax
    entry = out.logprobs["p"]
    assert list(entry) == [2, 1]  # the sampled token, then the top-2 (which include it)
    assert entry == pytest.approx({2: raw[2].item(), 1: raw[1].item()}, abs=1e-6)  # before penalty and temperature
    assert out.logprobs["s"] == pytest.approx({out.token_ids["s"]: raw[out.token_ids["s"]].item()}, abs=1e-6)


def test_a_row_that_raises_fails_only_its_own_request():
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    rows = [
        Row("a", GREEDY),
        Row("b", poisoned(SamplingParams(temperature=1.0))),
        Row("c", SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=1)),
    ]
    out = Sampler(0, torch.device("cpu")).sample(logits, rows)
    assert set(out.errors) == {"b"} and "sampling failed" in out.errors["b"]
    assert out.token_ids["a"] == logits[0].argmax().item()
    assert set(out.token_ids) == {"a", "c"} and set(out.logprobs) == {"c"}


def test_a_request_whose_sampling_fails_ends_alone_and_the_others_go_on(make_llm):
    llm = make_llm()
    prompts = [{"prompt_token_ids": list(range(start, start + 15))} for start in (3, 30, 60)]
    seeded = SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)
    alone = [llm.generate(prompts[i], p, use_tqdm=False)[0].outputs[0].token_ids for i, p in ((0, GREEDY), (2, seeded))]
    bad = poisoned(SamplingParams(max_tokens=10, ignore_eos=True))
    outputs = llm.generate(prompts, [GREEDY, bad, seeded], use_tqdm=False)
    failed = outputs[1].outputs[0]
    assert (failed.finish_reason, failed.token_ids) == ("abort", [])
    assert "sampling failed" in failed.error and "nan" in failed.error
    assert [outputs[0].outputs[0].token_ids, outputs[2].outputs[0].token_ids] == alone
    assert all(o.outputs[0].error is None for o in (outputs[0], outputs[2]))


def test_generated_token_logprobs_match_transformers(make_llm, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    llm = make_llm()
    prompt = list(range(3, 20))
    params = SamplingParams(max_tokens=6, temperature=0.7, seed=5, logprobs=3, ignore_eos=True)
    completion = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + completion.token_ids])).logits[0].log_softmax(-1)
    assert len(completion.logprobs) == 6
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        position = len(prompt) - 1 + i
        assert next(iter(entry)) == token
        top = ref[position].topk(3)
        expected = {token: ref[position, token].item()} | dict(
            zip(top.indices.tolist(), top.values.tolist(), strict=True)
        )
        assert entry == pytest.approx(expected, abs=1e-4)


def reference_distribution(logits: list[float], temperature: float, min_p: float, top_k: int = 0) -> list[float]:
    """vLLM's order written out in plain floats: temperature, then min-p on those probabilities, then top-k."""
    scaled = [x / temperature for x in logits]
    exps = [math.exp(x - max(scaled)) for x in scaled]
    probs = [e / sum(exps) for e in exps]
    kept = [p >= min_p * max(probs) for p in probs]
    if top_k:
        kth = sorted((x for x, k in zip(scaled, kept, strict=True) if k), reverse=True)[:top_k][-1]
        kept = [k and x >= kth for x, k in zip(scaled, kept, strict=True)]
    total = sum(p for p, k in zip(probs, kept, strict=True) if k)
    return [p / total if k else 0.0 for p, k in zip(probs, kept, strict=True)]


@pytest.mark.parametrize(
    ("temperature", "min_p", "top_k"),
    [(1.0, 0.2, 0), (0.5, 0.2, 0), (2.0, 0.2, 0), (1.0, 0.05, 2), (1.0, 1.0, 0), (1.0, 0.0, 0)],
)
def test_min_p_keeps_tokens_at_least_min_p_times_the_likeliest_after_temperature(temperature, min_p, top_k):
    from prefixcache.engine.sampler import distribution

    logits = [2.0, 1.5, 0.4, -0.3, 1.9, -2.0]
    params = SamplingParams(temperature=temperature, min_p=min_p, top_k=top_k)
    got = distribution(torch.tensor(logits), params).tolist()
    assert got == pytest.approx(reference_distribution(logits, temperature, min_p, top_k), abs=1e-6)


def test_min_p_changes_which_tokens_are_drawn_and_is_ignored_by_greedy():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    sampler = Sampler(0, torch.device("cpu"))
    rows = [Row(str(i), SamplingParams(temperature=1.0, min_p=0.5, seed=i)) for i in range(200)]
    draws = set(sampler.sample(logits.repeat(200, 1), rows).token_ids.values())
    assert draws == {0, 1}  # 0.0 and -1.0 are below half the likeliest token's probability
    assert greedy_pick([1.0, 3.0, 2.0], min_p=0.9) == 1


def test_min_tokens_bans_eos_and_stop_token_ids_until_enough_are_generated():
    eos = 0
    logits = torch.tensor([[5.0, 4.0, 3.0, 1.0]])  # EOS likeliest, then stop token 1, then 2

    def pick(params: SamplingParams, generated: int) -> int:
        row = Row("r", params, output_token_ids=[3] * generated)
        return Sampler(0, torch.device("cpu"), eos_token_ids=(eos,)).sample(logits, [row]).token_ids["r"]

    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(1,))
    assert [pick(params, generated) for generated in (0, 1, 2)] == [2, 2, 0]
    assert pick(SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True), 0) == 1  # vLLM: EOS banned anyway
    assert pick(SamplingParams(temperature=0.0), 0) == 0
    seeded = SamplingParams(temperature=5.0, min_tokens=3, stop_token_ids=(1,), seed=4)
    assert {pick(dataclasses.replace(seeded, seed=s), 1) for s in range(100)} == {2, 3}


def test_min_tokens_generation_matches_transformers_with_the_stop_tokens_masked(make_llm, tiny_llama_dir):
    """Reference: transformers' greedy decoding with EOS and the stop ids set to -inf for the first min_tokens."""
    from transformers import AutoModelForCausalLM

    llm = make_llm()
    prompt = list(range(5, 18))
    free = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_ids = (free[0], free[1])  # the tokens greedy decoding would start with
    params = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=4, stop_token_ids=stop_ids)
    completion = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    banned = [*llm.engine.core.eos_token_ids, *stop_ids]
    expected = []
    with torch.no_grad():
        while len(expected) < params.max_tokens:
            logits = hf(torch.tensor([prompt + expected])).logits[0, -1]
            if len(expected) < params.min_tokens:
                logits[banned] = float("-inf")
            expected.append(int(logits.argmax()))
            if expected[-1] in banned and len(expected) > params.min_tokens:
                break
    assert completion.token_ids == expected
    assert len(completion.token_ids) > params.min_tokens


def tied_logits(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of few distinct values (many equal maxima), a -inf row, signed zeros, NaNs and an inf: where an argmax's
    tie-break shows, as bfloat16 logits (8 bits of mantissa) tie often. A view strided across rows, as a gather's."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 3, (rows, vocab + 5), generator=g).to(dtype)[:, 3 : 3 + vocab]
    logits[0] = float("-inf")
    logits[1] = torch.where(torch.rand(vocab, generator=g) < 0.5, -0.0, 0.0)  # -0 == +0: the first wins
    logits[2, [vocab - 1, vocab // 2]] = float("nan")  # a NaN is above any number: the first NaN wins
    logits[3, vocab - 1] = float("inf")
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 17, 100, 49152])  # one token, no multiple of 16 or 64 floats, SmolLM2's
@pytest.mark.parametrize("kernels", [True, False])
def test_greedy_tokens_are_the_float32_argmax_ties_and_nans_included(monkeypatch, dtype, vocab, kernels):
    from prefixcache.engine import sampler

    if not kernels:
        monkeypatch.setattr(sampler, "native_ops", lambda: None)  # torch's max, as where the kernels cannot build
    logits = tied_logits(9, vocab, dtype, seed=vocab)
    expected = logits.float().argmax(dim=-1).tolist()  # what the sampler picked before: float32, then argmax
    assert sampler.greedy_tokens(logits) == expected
    if vocab > 1:
        assert expected[:4] == [0, 0, vocab // 2, vocab - 1]


def test_bfloat16_logits_sample_as_their_float32_copy_did():
    """The sampler converts only the rows that need float32 values: every row's result is the float32 path's."""
    logits = tied_logits(7, 64, torch.bfloat16, seed=1)
    logits[4:] = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    top = int(logits[4].float().argmax())
    rows = [
        Row("greedy-inf", GREEDY),
        Row("greedy-zeros", GREEDY),
        Row("greedy-nan", GREEDY),
        Row("greedy-inf-token", GREEDY),
        Row("penalized", SamplingParams(temperature=0.0, repetition_penalty=100.0), output_token_ids=[top]),
        Row("logprobs", SamplingParams(temperature=0.0, logprobs=2)),
        Row("drawn", SamplingParams(temperature=0.8, seed=3, logprobs=1)),
    ]
    got = Sampler(0, torch.device("cpu")).sample(logits, rows)
    expected = Sampler(0, torch.device("cpu")).sample(logits.float(), rows)
    assert got == expected
    assert [got.token_ids[r.request_id] for r in rows[:4]] == [0, 0, 32, 63]
    assert got.token_ids["penalized"] != top and set(got.logprobs) == {"logprobs", "drawn"}
