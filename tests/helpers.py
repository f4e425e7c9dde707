"""Tiny random-weight checkpoints built offline, for engine, server and benchmark tests, a bounded wait, and
llama.cpp's greedy tokens as the reference for the real-model tests."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

# Tool definitions, when a request has them, come first as JSON lines in a turn of their own (as Qwen's templates
# put them); without tools the template renders what it always did.
CHAT_TEMPLATE = (
    "{% if tools %}<|tools|>{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}<|end|>"
    "{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefix caching reuses the keys and values of shared prompt prefixes.",
    "You are a helpful assistant. Answer briefly and truthfully.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]


BOS = "<|bos|>"


def build_tokenizer(bos: bool = False):
    """A byte-level BPE tokenizer (exact round trip for any text) with an EOS token and a chat template.

    ``bos``: it also adds a BOS token before every text it encodes with special tokens, as Llama's, Gemma's and
    Mistral's do (id 2; the chat template writes it too, so a chat has exactly one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|eos|>", "<|end|>", *([BOS] if bos else [])],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    extra = {}
    if bos:
        bos_id = tokenizer.token_to_id(BOS)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
        )
        extra["bos_token"] = BOS
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|eos|>", pad_token="<|eos|>", **extra)
    wrapped.chat_template = (BOS if bos else "") + CHAT_TEMPLATE
    return wrapped


def write_tiny_checkpoint(
    path: Path,
    architecture: str = "llama",
    seed: int = 0,
    randomize_norms: bool = False,
    bos: bool = False,
    **overrides,
) -> Path:
    """Save a tiny random-weight checkpoint with the tokenizer above (``bos``: the one that adds a BOS);
    ``architecture`` is a transformers model type (llama, mistral, qwen2, qwen3, gemma3_text, qwen3_5_text,
    granitemoehybrid, lfm2) and ``overrides`` are its config fields. ``qwen3_5`` saves a
    ``Qwen3_5ForConditionalGeneration`` (the text fields go into its ``text_config``, beside a one-block vision
    tower).

    ``randomize_norms`` draws norm weights and biases at random too (transformers sets them to constants), and
    slow decays for recurrent layers, so that every parameter visibly moves the logits and a mistake in any of
    them shows.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tokenizer(bos)
    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    torch.manual_seed(seed)
    if architecture == "qwen3_5":
        from transformers import Qwen3_5ForConditionalGeneration

        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=common["hidden_size"])
        config = AutoConfig.for_model(
            architecture, text_config=common, vision_config=vision, tie_word_embeddings=common["tie_word_embeddings"]
        )
        model = Qwen3_5ForConditionalGeneration(config)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(architecture, **common))
    if randomize_norms:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.copy_(1 + 0.2 * torch.randn_like(param))
                elif name.endswith("A_log"):
                    # Slow decays (transformers' init forgets within a few tokens), so a recurrent state
                    # carries far and a wrong one shows.
                    param.copy_(torch.empty_like(param).uniform_(0.01, 0.3).log())
                elif name.endswith("bias"):
                    param.copy_(0.2 * torch.randn_like(param))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def assert_no_leaks(llm) -> None:
    """Nothing left running, every block back in the pool, and the manager's invariants hold."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.core.manager.num_free_blocks == engine.core.manager.num_usable_blocks, "blocks leaked"
    engine.core.manager.check_invariants()


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """/metrics as {sample name: value}, summed over label sets (e.g. every finish reason), and per label set
    as ``name{label="value"}`` (labels other than ``model_name``, e.g. ``..._total{finished_reason="abort"}``)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{url}/metrics", headers=headers, timeout=10)
    response.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model_name")
            if labels:
                values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


def wait_until(condition, timeout: float = 20.0, what: str = "condition") -> None:
    """Poll ``condition`` (no timing is asserted: the deadline only bounds a hang)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def hybrid_workload(seed: str, count: int, block_size: int) -> list[list[int]]:
    """Prompts for a hybrid model's cache (see ``tiny_gemma3_dir``): questions on a shared 6-block document
    (sharing 2, 4 or all 6 of its blocks) and unique fillers, each whole blocks ending with a block of its
    own; token ids clear of the tiny tokenizer's special ids. Through a small pool the full group evicts the
    document's early blocks while sliding groups still hold them, and the other way round."""
    import random

    rng = random.Random(seed)

    def tokens(num_blocks: int) -> list[int]:
        return [rng.randrange(2, 400) for _ in range(num_blocks * block_size)]

    document = tokens(6)
    prompts = []
    for i in range(count):
        shared = 0 if i % 4 == 3 else rng.choice((2, 4, 6))
        own = rng.randint(1, 3) if shared else rng.randint(4, 6)
        prompts.append(document[: shared * block_size] + tokens(own))
    return prompts


# The real-model prompt set: greedy tokens compared with llama.cpp's on the same GGUF (tests/engine and
# tests/server), each prompt given the tokenizer's BOS as llama.cpp's completions do.
REAL_MODEL_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
)
REAL_MODEL_MAX_TOKENS = 24
# Two implementations of one quantized model pick different tokens only where their top two are this close
# (nats): llama.cpp multiplies Q4_K/Q5_0/Q6_K weights with activations quantized to 8 bits, the engine with
# the dequantized float32 weights. Measured on Gemma 3 270M: top-two gaps differ by at most 0.40 between the
# two, the greedy token's log-probability by at most 0.17.
NEAR_TIE_NATS = 0.5
LOGPROB_TOLERANCE_NATS = 0.3


@dataclass(frozen=True)
class GreedyReference:
    """One greedy completion of another engine: the prompt's ids and, per generated token, its id and the top
    two (id, log-probability), best first."""

    prompt_ids: list[int]
    token_ids: list[int]
    top2: list[list[tuple[int, float]]]


def llamacpp_greedy(gguf: Path, prompts: Sequence[str], max_tokens: int) -> list[GreedyReference]:
    """Greedy completions of text ``prompts`` by llama.cpp's server (the ``xllamacpp`` wheel, in-process on
    loopback, 2 threads), which tokenizes them itself with the GGUF's tokenizer and its BOS."""
    import httpx
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = str(gguf)
    params.n_parallel = 1
    params.n_ctx = 2048
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = 2
    server = xllamacpp.Server(params)
    try:
        references = []
        for prompt in prompts:
            tokenized = httpx.post(
                f"{server.listening_address}/tokenize", json={"content": prompt, "add_special": True}, timeout=60
            )
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "n_probs": 2, "cache_prompt": False}
            content = server.handle_completions(body)["choices"][0]["logprobs"]["content"]
            references.append(
                GreedyReference(
                    prompt_ids=tokenized.json()["tokens"],
                    token_ids=[entry["id"] for entry in content],
                    top2=[[(top["id"], top["logprob"]) for top in entry["top_logprobs"]] for entry in content],
                )
            )
        return references
    finally:
        del server  # stops llama.cpp's threads and frees its model


def assert_greedy_agrees(token_ids: Sequence[int], logprobs: Sequence[dict[int, float]], ref: GreedyReference) -> int:
    """Our greedy tokens equal the reference's up to the first token where they differ, which must be a near-tie
    on either side (top two within NEAR_TIE_NATS); the tokens compared have the reference's log-probabilities
    within LOGPROB_TOLERANCE_NATS. Returns how many tokens were compared before that near-tie (all, if none)."""
    for i, (ours, theirs) in enumerate(zip(token_ids, ref.token_ids, strict=True)):
        if ours != theirs:
            our_top = sorted(logprobs[i].values(), reverse=True)
            gaps = (our_top[0] - our_top[1], ref.top2[i][0][1] - ref.top2[i][1][1])
            assert min(gaps) < NEAR_TIE_NATS, f"token {i}: {ours} against {theirs}, top-two gaps {gaps} (no near-tie)"
            return i
        assert logprobs[i][ours] == pytest.approx(ref.top2[i][0][1], abs=LOGPROB_TOLERANCE_NATS), f"token {i}"
    return len(ref.token_ids)
