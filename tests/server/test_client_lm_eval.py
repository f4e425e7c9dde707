"""lm-eval's ``local-completions`` against a real server agrees with lm-eval's own ``hf`` backend on the same
tiny checkpoint: log-likelihoods (the echo-with-logprobs path every multiple-choice task uses) and greedy
generations. The server's tokenizer is found through /tokenizer_info (lm-eval's remote tokenizer); nothing is
downloaded."""

import pytest
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.models.openai_completions import LocalCompletionsAPI

PAIRS = [
    ("The quick brown", " fox jumps over"),
    ("Prefix caching reuses", " the keys and values"),
    ("You are a helpful assistant.", " Answer briefly"),
    ("0123456789", " abcdefghij"),
]


def instances(kind: str, arguments: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(arguments)]


@pytest.fixture(scope="module")
def models(server, model_name, tiny_llama_dir):
    """Both backends; the hf one offline, so a missing file fails instead of reaching for the hub."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        remote = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model=model_name, max_retries=1)
        local = HFLM(pretrained=str(tiny_llama_dir), device="cpu", dtype="float32", batch_size=1)
    return remote, local


def test_local_completions_finds_the_tokenizer_through_the_server(models):
    remote, _ = models
    assert remote.tokenizer_backend == "remote"
    assert remote.tokenizer.eos_token == "<|eos|>"


def test_loglikelihoods_agree_with_the_hf_backend(models):
    remote, local = models
    served = remote.loglikelihood(instances("loglikelihood", PAIRS))
    reference = local.loglikelihood(instances("loglikelihood", PAIRS))
    for (logprob, greedy), (expected, expected_greedy) in zip(served, reference, strict=True):
        assert logprob == pytest.approx(expected, abs=1e-4)
        assert greedy == expected_greedy


def test_greedy_generations_agree_with_the_hf_backend(models):
    remote, local = models
    requests = [(context, {"until": ["\n"], "max_gen_toks": 8, "do_sample": False}) for context, _ in PAIRS[:2]]
    assert remote.generate_until(instances("generate_until", requests)) == local.generate_until(
        instances("generate_until", requests)
    )
