"""End-to-end engine behaviour on a tiny random model: same outputs with and without the cache."""

import dataclasses
import random

import pytest

from prefixcache.engine import LLM, SamplingParams
from prefixcache.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def shared_prefix_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts over three prefixes: block-aligned (16), unaligned (13 and 30), plus exact repeats."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(n)] for n in (16, 13, 30)]
    prompts = []
    for i in range(12):
        suffix = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 9))]
        prompts.append(prefixes[i % 3] + suffix)
    return prompts + prompts[:3]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def run(llm: LLM, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def reference_tokens(tiny_loaded, tiny_llama_dir):
    """Greedy outputs without any cache, one request at a time."""
    llm = LLM(
        str(tiny_llama_dir),
        loaded=tiny_loaded,
        dtype="float32",
        enable_prefix_caching=False,
        num_blocks=256,
        block_size=4,
    )
    return [token_ids(run(llm, [p]))[0] for p in shared_prefix_prompts()]


def test_cache_on_matches_cache_off_and_hits(make_llm, reference_tokens):
    llm = make_llm(enable_prefix_caching=True)
    outputs = run(llm, shared_prefix_prompts())
    assert token_ids(outputs) == reference_tokens
    assert sum(o.num_cached_tokens for o in outputs) > 0
    stats = llm.stats()
    assert stats.prefix_cache_hits == sum(o.num_cached_tokens for o in outputs)
    assert 0 < stats.prefix_cache_hit_rate < 1


def test_batched_without_cache_matches_one_by_one(make_llm, reference_tokens):
    assert token_ids(run(make_llm(enable_prefix_caching=False), shared_prefix_prompts())) == reference_tokens


def test_chunked_prefill_matches(make_llm, reference_tokens):
    llm = make_llm(max_num_batched_tokens=7)  # prompts are split into chunks of up to 7 tokens
    assert token_ids(run(llm, shared_prefix_prompts())) == reference_tokens


def test_requests_sharing_a_prefix_inside_one_step(make_llm, reference_tokens, monkeypatch):
    """All prompts admitted in one step: later ones hit blocks the earlier ones are filling in that step."""
    llm = make_llm(max_num_batched_tokens=4096, max_num_seqs=64)
    scheduler = llm.engine.core.scheduler
    steps = []
    schedule = scheduler.schedule
    monkeypatch.setattr(scheduler, "schedule", lambda: steps.append(schedule()) or steps[-1])
    assert token_ids(run(llm, shared_prefix_prompts())) == reference_tokens
    assert len(steps[0].chunks) == len(shared_prefix_prompts())
    assert any(c.start > 0 for c in steps[0].chunks), "no request hit a block filled in the same step"


def test_memory_pressure_preempts_and_evicts_without_changing_outputs(make_llm, reference_tokens):
    """Preempted requests resume by re-reading their own blocks: those hits are counted apart, not as sharing."""
    llm = make_llm(num_blocks=24, max_num_seqs=16)  # 96 token slots for 15 requests of up to 50 tokens
    assert token_ids(run(llm, shared_prefix_prompts())) == reference_tokens
    stats = llm.stats()
    manager_stats = llm.engine.core.manager.stats
    assert stats.num_preemptions > 0
    assert manager_stats.requests == len(shared_prefix_prompts())  # each request counted once
    assert manager_stats.preempted_requests == stats.num_preemptions
    assert stats.prefix_cache_preempted_hits > 0, "no preempted request hit its own surviving blocks"
    assert (stats.prefix_cache_preempted_queries, stats.prefix_cache_preempted_hits) == (
        manager_stats.preempted_queries,
        manager_stats.preempted_hits,
    )
    assert stats.prefix_cache_queries == sum(len(p) for p in shared_prefix_prompts())  # resumptions not in it


def test_reset_prefix_cache_forgets(make_llm):
    llm = make_llm()
    prompt = list(range(3, 40))
    assert run(llm, [prompt])[0].num_cached_tokens == 0
    assert run(llm, [prompt])[0].num_cached_tokens == 36
    assert llm.reset_prefix_cache() is True
    assert run(llm, [prompt])[0].num_cached_tokens == 0


def test_salts_isolate_tenants(make_llm):
    llm = make_llm()
    prompt = [{"prompt_token_ids": list(range(3, 40))}]
    assert llm.generate(prompt, GREEDY, use_tqdm=False, cache_salt="a")[0].num_cached_tokens == 0
    assert llm.generate(prompt, GREEDY, use_tqdm=False, cache_salt="b")[0].num_cached_tokens == 0
    assert llm.generate(prompt, GREEDY, use_tqdm=False, cache_salt="a")[0].num_cached_tokens == 36


def test_stop_conditions(make_llm, reference_tokens):
    llm = make_llm()
    prompt = shared_prefix_prompts()[0]
    expected = reference_tokens[0]
    out = run(llm, [prompt], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == expected[:5] and out.finish_reason == "length"
    stop_token = expected[3]
    first = expected.index(stop_token)
    out = run(llm, [prompt], dataclasses.replace(GREEDY, stop_token_ids=(stop_token,)))[0].outputs[0]
    assert out.token_ids == expected[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_token)


def test_stop_string_truncates_text(make_llm):
    llm = make_llm()
    full = run(llm, [list(range(3, 20))], dataclasses.replace(GREEDY, max_tokens=8))[0].outputs[0].text
    assert len(full) >= 4
    stop = full[2:4]
    out = run(llm, [list(range(3, 20))], dataclasses.replace(GREEDY, max_tokens=8, stop=(stop,)))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(make_llm):
    llm = make_llm()
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    alone = token_ids(run(llm, [list(range(3, 20))], params))[0]
    crowd = [list(range(3, 20))] + [list(range(30, 30 + n)) for n in range(5, 12)]
    mixed = [params] + [SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)] * 7
    assert token_ids(llm.generate([{"prompt_token_ids": p} for p in crowd], mixed, use_tqdm=False))[0] == alone


def test_prompt_logprobs_match_transformers(make_llm, tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM

    llm = make_llm(max_num_batched_tokens=5)
    prompt = list(range(3, 23))
    run(llm, [prompt])  # fills the cache; the logprobs request must not read it
    out = run(llm, [prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))[0]
    assert out.num_cached_tokens == 0
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry[prompt[pos]] == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)
        assert len(entry) in (2, 3)


def test_chat_applies_the_template(make_llm):
    llm = make_llm()
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    expected = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert llm.get_tokenizer().decode(out[0].prompt_token_ids) == expected


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ({"prompt_token_ids": []}, GREEDY, "empty"),
        ({"prompt_token_ids": [1, 99999]}, GREEDY, r"\[0, 512\)"),
        ({"prompt_token_ids": [1, -1]}, GREEDY, r"\[0, 512\)"),
        ({"prompt_token_ids": [1] * 1020}, GREEDY, "context length"),
        ({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2000), "context length"),
        ({"prompt_token_ids": "abc"}, GREEDY, "list of integers"),
        (3.5, GREEDY, "a prompt is"),
    ],
)
def test_bad_input_is_rejected_and_leaves_nothing_behind(make_llm, prompt, params, message):
    llm = make_llm()
    good = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match=message):
        llm.generate([good, prompt], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert run(llm, [good["prompt_token_ids"]])[0].outputs[0].token_ids


def test_prompt_larger_than_the_kv_cache_is_rejected(make_llm):
    llm = make_llm(num_blocks=4)
    with pytest.raises(ValueError, match="KV cache"):
        run(llm, [list(range(3, 20))])


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"max_model_len": 1025}, r"max_model_len 1025 \(--max-model-len\) is longer than the 1,024 positions"),
        ({"num_blocks": 1}, r"num_blocks 1 \(--num-gpu-blocks-override\) is fewer than the 2 KV blocks"),
        ({"num_blocks": None, "kv_cache_memory": "1KiB"}, r"kv_cache_memory '1KiB' \(--kv-cache-memory\) holds"),
    ],
)
def test_settings_the_engine_cannot_run_are_refused_naming_the_flag(make_llm, settings, message):
    with pytest.raises(ValueError, match=message):
        make_llm(**settings)


def test_a_device_torch_cannot_use_is_refused_before_the_model_loads(make_llm):
    with pytest.raises(ValueError, match=r"device 'tpu' \(--device\) cannot be used here"):
        make_llm(device="tpu")


def test_a_context_beyond_what_the_kv_cache_holds_is_warned_about_at_start_up(make_llm, caplog):
    llm = make_llm(num_blocks=8, max_model_len=1024)  # 32 tokens of KV cache
    assert "max_model_len 1024 (--max-model-len) is more than the KV cache can ever hold" in caplog.text
    assert llm.engine.info.max_request_tokens == 32
    fits = SamplingParams(max_tokens=8, ignore_eos=True)
    [out] = llm.generate({"prompt_token_ids": list(range(3, 27))}, fits, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 8  # 24 + 8: the whole KV cache
    with pytest.raises(ValueError, match="cannot fit the KV cache of 32 tokens"):
        llm.generate({"prompt_token_ids": list(range(3, 28))}, fits, use_tqdm=False)


def test_non_causal_model_turns_prefix_caching_off(tiny_loaded, caplog):
    loaded = dataclasses.replace(tiny_loaded, config=dataclasses.replace(tiny_loaded.config, is_causal=False))
    from prefixcache.config import EngineConfig

    engine = LLMEngine(EngineConfig(num_blocks=64, block_size=4, dtype="float32"), loaded)
    assert engine.core.manager.enable_caching is False
    assert "not causal" in caplog.text


def test_abort_frees_blocks(make_llm):
    llm = make_llm()
    engine = llm.engine
    request_id = engine.add_request({"prompt_token_ids": list(range(3, 40))}, GREEDY)
    engine.step()
    assert engine.core.manager.num_free_blocks < engine.core.manager.num_blocks
    assert engine.abort_request(request_id) is True
    assert engine.abort_request(request_id) is False


def test_streamed_deltas_add_up_to_the_final_text_even_when_a_stop_string_cuts_it(make_llm):
    llm = make_llm()
    prompt = list(range(3, 20))
    full = run(llm, [prompt], dataclasses.replace(GREEDY, max_tokens=10))[0].outputs[0].text
    stop = full[3:6]
    engine = llm.engine
    engine.add_request({"prompt_token_ids": prompt}, dataclasses.replace(GREEDY, max_tokens=10, stop=(stop,)))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            deltas.append(output.new_text)
            final = output
    assert final.finished and final.outputs[0].stop_reason == stop
    assert "".join(deltas) == final.outputs[0].text == full[: full.index(stop)]


def test_incremental_detokenizer_matches_full_decode(tiny_loaded):
    from prefixcache.engine.detokenizer import IncrementalDetokenizer

    tokenizer = tiny_loaded.tokenizer
    ids = tokenizer.encode("Prefix caching: ünïcode ✓ and emoji 🙂 survive token splits.")
    detokenizer = IncrementalDetokenizer(tokenizer)
    text = "".join(detokenizer.decode_new(ids[: i + 1]) for i in range(len(ids)))
    text += detokenizer.decode_new(ids, final=True)
    assert text == tokenizer.decode(ids)


def test_every_command_line_parses():
    """Commands share the engine flags; a clash would only show when the command runs."""
    from prefixcache.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--sub-block-size", "4", "--block-size", "16"]).sub_block_size == 4
    assert parser.parse_args(["generate", "hi", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parser.parse_args(["chat", "--eviction-policy", "lru"]).message is None


def test_weights_in_another_dtype_than_the_engine_are_refused(tiny_loaded, tiny_llama_dir):
    with pytest.raises(ValueError, match="the loaded model is float32 but the engine runs bfloat16"):
        LLM(str(tiny_llama_dir), loaded=tiny_loaded, dtype="bfloat16", num_blocks=16)


def test_the_progress_bar_counts_tokens_and_moves_during_a_long_prefill(make_llm):
    """Two 40-token prompts prefilled 8 tokens a step: the bar advances every step before any request ends."""
    import io

    from tqdm import tqdm

    bars: list[tqdm] = []
    history: list[tuple[int, str]] = []

    def recording_bar(**kwargs):
        bar = tqdm(**kwargs, file=io.StringIO())
        update = bar.update

        def record(n=1):
            update(n)
            history.append((bar.n, bar.postfix or ""))

        bar.update = record
        bars.append(bar)
        return bar

    llm = make_llm(max_num_batched_tokens=8, max_num_seqs=1)
    prompts = [list(range(3, 43)), list(range(50, 90))]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=recording_bar)
    assert bars[0].total == 2 * (40 + 3) and bars[0].unit == "tok"
    before_first_finish = [n for n, postfix in history if postfix.startswith("0/2")]
    assert before_first_finish[:5] == [8, 16, 24, 32, 41]  # a prefill chunk a step; the last one samples a token
    assert [n for n, _ in history] == sorted(n for n, _ in history)  # never backwards
    assert history[-1] == (86, "2/2 requests")


def test_the_shared_retention_rule_raises_what_two_requests_share_and_changes_no_output(make_llm):
    from prefixcache.core import Request
    from prefixcache.core.retention import DEFAULT_PRIORITY
    from prefixcache.core.retention_rules import SharedPrefixRetention

    prefix = list(range(3, 19))  # 4 blocks of 4
    prompts = [prefix + [40, 41], prefix + [50, 51]]
    plain, ruled = make_llm(), make_llm(retention_rule="shared")
    outputs = {}
    for name, llm in (("plain", plain), ("ruled", ruled)):
        outputs[name] = [run(llm, [prompt])[0].outputs[0].token_ids for prompt in prompts]  # one after the other
    assert outputs["ruled"] == outputs["plain"]
    manager = ruled.engine.core.manager
    raised = {b.block_hash for b in manager.pool.blocks if b.priority == SharedPrefixRetention.PRIORITY}
    assert raised == set(manager.block_hashes(Request("probe", prefix)))
    assert all(b.priority == DEFAULT_PRIORITY for b in plain.engine.core.manager.pool.blocks)
