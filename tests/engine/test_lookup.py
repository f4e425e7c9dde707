"""``llm.lookup``: what a prompt would find in the cache now, without running it or changing anything."""

from prefixcache.engine import SamplingParams
from tests.core.conftest import manager_state

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def test_lookup_predicts_the_hit_and_changes_nothing(make_llm):
    llm = make_llm()  # 4-token blocks
    prompt = list(range(3, 21))  # 18 tokens
    assert llm.lookup(prompt).cached_tokens == 0
    llm.generate([prompt], ONE_TOKEN, use_tqdm=False)
    follow_up = {"prompt_token_ids": prompt[:14] + [300, 301, 302]}
    before = manager_state(llm.engine.core.manager)
    found = llm.lookup(follow_up)
    assert manager_state(llm.engine.core.manager) == before
    assert (found.prompt_tokens, found.cached_tokens, found.cached_prefix_end) == (17, 12, 12)
    assert found.first_miss_reason == "new"
    [out] = llm.generate([follow_up], ONE_TOKEN, use_tqdm=False)
    assert out.num_cached_tokens == found.cached_tokens
    assert llm.lookup(prompt, cache_salt="tenant").cached_tokens == 0


def test_lookup_tokenizes_text_like_generate(make_llm):
    llm = make_llm()
    text = "Prefix caching reuses the keys and values of shared prompt prefixes."
    [out] = llm.generate([text], ONE_TOKEN, use_tqdm=False)
    found = llm.lookup(text)
    assert found.prompt_tokens == len(out.prompt_token_ids)
    assert found.cached_tokens == (len(out.prompt_token_ids) - 1) // 4 * 4


def test_generate_gives_a_text_the_tokenizers_bos_and_lookup_hashes_it_alike(make_llm, tiny_bos_dir):
    """vLLM's offline generate adds the tokenizer's special tokens to a text prompt; so do generate and lookup."""
    from prefixcache.model import load_model

    llm = make_llm(loaded=load_model(str(tiny_bos_dir), dtype="float32", device="cpu"))
    tokenizer = llm.get_tokenizer()
    text = "Prefix caching reuses the keys and values of shared prompt prefixes."
    [out] = llm.generate([text], ONE_TOKEN, use_tqdm=False)
    assert out.prompt_token_ids == [tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False)]
    follow_up = text + " The quick brown fox"
    found = llm.lookup(follow_up)
    [again] = llm.generate([follow_up], ONE_TOKEN, use_tqdm=False)
    assert again.prompt_token_ids[0] == tokenizer.bos_token_id
    assert again.num_cached_tokens == found.cached_tokens > 0


def test_stats_count_missed_tokens_by_reason(make_llm):
    llm = make_llm(num_blocks=8)  # 32 token slots
    first = list(range(3, 13))  # 10 tokens: 8 hittable, 2 in the partial block
    llm.generate([first], ONE_TOKEN, use_tqdm=False)
    # 7 blocks: the 6 never used, then the first prompt's second block (freed tail first); its first survives
    llm.generate([list(range(100, 128))], ONE_TOKEN, use_tqdm=False)
    assert llm.lookup(first).missed_tokens["evicted"] == 4
    [out] = llm.generate([first], ONE_TOKEN, use_tqdm=False)
    assert out.num_cached_tokens == 4
    stats = llm.stats()
    assert stats.prefix_cache_missed_tokens == {
        "new": 8 + 24,
        "evicted": 4,
        "expired": 0,
        "evicted_below_retained": 0,
        "partial_block": 2 + 4 + 2,
        "skipped": 0,
        "no_checkpoint": 0,
    }
    assert stats.prefix_cache_queries == stats.prefix_cache_hits + sum(stats.prefix_cache_missed_tokens.values())
