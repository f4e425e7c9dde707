"""One configurable decoder for the Llama family (Llama, Mistral, Qwen2) running on a paged KV cache.

The math mirrors HF transformers' implementation op for op (RMSNorm in float32, RoPE cos/sin computed in
float32 then cast, SDPA with the same scale) so that logits match it. Q/K/V and gate/up projections are fused
into one matmul each; :meth:`DecoderForCausalLM.load_weights` maps HF's separate weights onto them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from prefixcache.model.attention import AttentionMetadata, GatherWorkspace, paged_attention

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_ARCH_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture hyper-parameters the model needs, independent of the transformers version.

    Sliding-window attention (Mistral, Qwen2 with ``use_sliding_window``) is supported by masking: all K/V
    stays in the cache, a layer with window W lets a query at position p see keys at positions > p - W.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    is_causal: bool = True
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
    # Llama's ``attention_bias`` also puts a bias on o_proj; Qwen2 has one on q/k/v only.
    o_proj_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    # Per layer "full_attention" or "sliding_attention"; empty means every layer uses ``sliding_window``.
    layer_types: tuple[str, ...] = ()

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer, or None for full attention."""
        if self.sliding_window is None or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes one token's K and V take across all layers, to size a cache before any model is loaded."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> ModelConfig:
        """Read a transformers config (v4 or v5 field names); ValueError for anything unsupported."""
        architectures = getattr(hf_config, "architectures", None) or []
        model_type = getattr(hf_config, "model_type", None)
        arch = architectures[0] if architectures else _ARCH_BY_MODEL_TYPE.get(model_type or "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch or model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (only 'silu' / SwiGLU is implemented)")

        num_heads = hf_config.num_attention_heads
        num_layers = hf_config.num_hidden_layers
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        rope_theta, rope_scaling = _rope_params(hf_config)

        attention_bias = o_proj_bias = mlp_bias = False
        if arch == "LlamaForCausalLM":
            attention_bias = o_proj_bias = bool(getattr(hf_config, "attention_bias", False))
            mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        elif arch == "Qwen2ForCausalLM":
            attention_bias = True

        sliding_window, layer_types = _sliding_window(hf_config, arch, num_layers)
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=hf_config.intermediate_size,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=rope_theta,
            max_position_embeddings=hf_config.max_position_embeddings,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            is_causal=True,
            eos_token_ids=eos_ids,
            architecture=arch,
            o_proj_bias=o_proj_bias,
            mlp_bias=mlp_bias,
            sliding_window=sliding_window,
            layer_types=layer_types,
        )


def _rope_params(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from v5 ``rope_parameters`` or v4 ``rope_theta``/``rope_scaling``."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type RoPE parameters are not supported")
    theta = params.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None) or 10000.0
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if factor not in (None, 1.0):
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor={factor}) are not supported")
    if rope_type == "default":
        return float(theta), None
    params.pop("type", None)
    params["rope_type"] = rope_type
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    return float(theta), params


def _sliding_window(hf_config: Any, arch: str, num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """Window size and per-layer types, following how HF's Mistral and Qwen2 apply ``sliding_window``."""
    if arch == "LlamaForCausalLM" or not getattr(hf_config, "use_sliding_window", True):
        return None, ()
    window = getattr(hf_config, "sliding_window", None)
    if window is None or window >= hf_config.max_position_embeddings:
        return None, ()
    if arch == "MistralForCausalLM":
        return int(window), ()
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        first = getattr(hf_config, "max_window_layers", 0)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if "sliding_attention" not in layer_types:
        return None, ()
    return int(window), tuple(layer_types)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies (float32, CPU), computed exactly as transformers does."""
    dim = config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, weight applied after casting back (as HF does)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's RoPE convention: the two halves of head_dim form the (real, imaginary) pairs."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderAttention(nn.Module):
    """GQA self-attention with one fused QKV matmul; K/V go to the paged cache (see paged_attention)."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.layer_window(layer)
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_proj_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        workspace: GatherWorkspace,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale, self.sliding_window, workspace)
        return self.o_proj(out)


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, layer)
        self.mlp = GatedMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        workspace: GatherWorkspace,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, metadata, workspace)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """The decoder stack, named like HF's ``model.*`` so checkpoint names map directly."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# HF checkpoint names of the weights stored inside fused parameters: (fused name, shard index).
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class DecoderForCausalLM(nn.Module):
    """Decoder whose attention reads and writes a paged KV cache (see :mod:`prefixcache.model.attention`).

    Parameter names follow HF's except for the fused ``qkv_proj`` and ``gate_up_proj``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {config.architecture!r}")
        if not config.is_causal:
            raise ValueError("only causal decoders are implemented")
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # Plain attributes, not buffers: built on CPU even under a meta-device context, and not part of the
        # state dict; copied to each device the model runs on when first needed.
        self._inv_freq_cpu = rope_inv_freq(config)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self._workspace = GatherWorkspace()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Run the step's new tokens ``[T]`` at ``positions`` ``[T]``; returns final-normed hidden ``[T, H]``.

        The new tokens' K/V are written into ``kv_caches`` (one (K, V) pair per layer) at
        ``attn_metadata.slot_mapping`` before attention reads them.
        """
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(f"expected {self.config.num_layers} KV cache layers, got {len(kv_caches)}")
        x = self.model.embed_tokens(input_ids)
        cos, sin = self._rope(positions, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, attn_metadata, self._workspace)
        return self.model.norm(x)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[T, 1, head_dim]`` computed in float32 from positions, then cast (HF's order of ops)."""
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq[positions.device] = self._inv_freq_cpu.to(positions.device)
        freqs = positions[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` in float32 for the given hidden states (typically each request's last)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed per-layer (K, V), each ``[num_blocks, block_size, num_kv_heads, head_dim]``.

        Zeroed rather than empty: masked-out slots still enter the attention matmuls, and uninitialised
        memory could hold NaN/inf that would poison the result (0 * NaN = NaN).
        """
        param = self.model.embed_tokens.weight
        dtype = dtype or param.dtype
        device = device or param.device
        shape = (num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)
        return [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(self.config.num_layers)
        ]

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype | None = None) -> int:
        """Bytes one block takes across all layers (K and V), to size the cache from a memory budget."""
        return block_size * self.config.kv_bytes_per_token((dtype or self.model.embed_tokens.weight.dtype).itemsize)

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], device: torch.device | str | None = None
    ) -> None:
        """Install HF-named weights as the parameters; ValueError on unknown, missing or mis-shaped ones.

        Tensors are assigned rather than copied into the existing storage (only the fused projections are
        concatenated), so a model built on the meta device loads without a second copy of its weights; pass
        ``device`` then. Each weight is cast to its parameter's current dtype.
        """
        params = dict(self.named_parameters())
        shards: dict[str, dict[int, torch.Tensor]] = {name: {} for name in params}
        unexpected: list[str] = []
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
                continue
            *prefix, module, kind = name.split(".")
            fused, index = _STACKED.get(module, (module, 0))
            target = ".".join([*prefix, fused, kind])
            if target in shards:
                shards[target][index] = tensor
            else:
                unexpected.append(name)
        missing = [
            name
            for target, parts in shards.items()
            for index, name in enumerate(self._hf_names(target))
            if index not in parts
        ]
        if unexpected or missing:
            raise ValueError(f"checkpoint does not match the model: unexpected {unexpected}, missing {missing}")
        state = {}
        for target, parts in shards.items():
            param = params[target]
            tensor = parts[0] if len(parts) == 1 else torch.cat([parts[i] for i in range(len(parts))])
            if tensor.shape != param.shape:
                raise ValueError(f"weight {target} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            state[target] = tensor.to(device=param.device if device is None else device, dtype=param.dtype)
        self.load_state_dict(state, strict=True, assign=True)

    @staticmethod
    def _hf_names(param_name: str) -> list[str]:
        """The HF checkpoint names stored in one of our parameters, in shard order."""
        *prefix, module, kind = param_name.split(".")
        parts = _FUSED_PARTS.get(module, (module,))
        return [".".join([*prefix, part, kind]) for part in parts]
