"""Tiny random-weight checkpoints built offline, for engine, server and benchmark tests, and a bounded wait."""

from __future__ import annotations

import time
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefix caching reuses the keys and values of shared prompt prefixes.",
    "You are a helpful assistant. Answer briefly and truthfully.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]


def build_tokenizer():
    """A byte-level BPE tokenizer (exact round trip for any text) with an EOS token and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|eos|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|eos|>", pad_token="<|eos|>")
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def write_tiny_checkpoint(
    path: Path, architecture: str = "llama", seed: int = 0, randomize_norms: bool = False, **overrides
) -> Path:
    """Save a tiny random-weight checkpoint with the tokenizer above; ``architecture`` is a transformers
    model type (llama, mistral, qwen2, qwen3, gemma3_text, qwen3_5_text, granitemoehybrid, lfm2) and
    ``overrides`` are its config fields. ``qwen3_5`` saves a ``Qwen3_5ForConditionalGeneration`` (the text
    fields go into its ``text_config``, beside a one-block vision tower).

    ``randomize_norms`` draws norm weights and biases at random too (transformers sets them to constants), and
    slow decays for recurrent layers, so that every parameter visibly moves the logits and a mistake in any of
    them shows.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tokenizer()
    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
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
