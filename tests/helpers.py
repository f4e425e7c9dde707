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
    ``architecture`` is a transformers model type (llama, mistral, qwen2, qwen3, gemma3_text) and
    ``overrides`` are its config fields.

    ``randomize_norms`` draws norm weights and biases at random too (transformers sets them to constants), so
    that every parameter visibly moves the logits and a mistake in any of them shows.
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
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(architecture, **common))
    if randomize_norms:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.copy_(1 + 0.2 * torch.randn_like(param))
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
