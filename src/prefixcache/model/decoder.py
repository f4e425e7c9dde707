"""One configurable decoder for every supported architecture (Llama, Mistral, Qwen2, Qwen3, Gemma 3) on a
paged KV cache.

The architectures differ only in settings of :class:`~prefixcache.model.config.ModelConfig`: biases, q/k
norms, Gemma's norm layout and embedding scale, the MLP activation, per-layer sliding windows and RoPE bases.
The math mirrors HF transformers' implementation op for op (RMSNorm in float32, RoPE cos/sin computed in
float32 then cast, SDPA with the same scale) so that logits match it. Q/K/V and gate/up projections are fused
into one matmul each; :meth:`DecoderForCausalLM.load_weights` maps HF's separate weights onto them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from prefixcache.model.attention import AttentionMetadata, GatherWorkspace, paged_attention
from prefixcache.model.config import SUPPORTED_ARCHITECTURES, KVCacheGroup, ModelConfig

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


def rope_inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """RoPE inverse frequencies (float32, CPU), computed exactly as transformers does."""
    dim = head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
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
    """RMSNorm computed in float32, as HF does.

    Llama's scales by ``weight`` after casting back; Gemma's (``unit_offset``) by ``1 + weight`` before.
    """

    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if unit_offset else torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        # F.rms_norm computes x * rsqrt(mean(x^2) + eps), HF's ops in HF's order, in one call.
        x32 = F.rms_norm(x.to(torch.float32), self.weight.shape, eps=self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's RoPE ``x * cos + rotate_half(x) * sin``, where the halves of head_dim form the (real, imaginary)
    pairs and ``rotate_half(x) = cat(-x2, x1)``: written as ``roll(x) * cat(-sin, sin)``, the same products
    bit for bit (a negation is exact), in four ops instead of seven."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class DecoderAttention(nn.Module):
    """GQA self-attention with one fused QKV matmul; K/V go to the paged cache (see paged_attention).

    With ``qk_norm`` each head's query and key are RMS-normed before RoPE (Qwen3, Gemma 3).
    """

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.layer_window(layer)
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_unit_offset)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_unit_offset)

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
        qkv = self.qkv_proj(x)
        q_size, kv_size, _ = self.split_sizes
        v = qkv[:, q_size + kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(qkv[:, :q_size].view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, q_size : q_size + kv_size].view(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:  # Q and K side by side in the projection: one rotation for both
            qk = qkv[:, : q_size + kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = apply_rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale, self.sliding_window, workspace)
        return self.o_proj(out)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with tanh GELU; gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.act = _ACTIVATIONS[config.hidden_act]
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)).

    With ``sandwich_norm`` (Gemma) the attention and MLP outputs are normed too before each residual add; HF
    names those four norms input, post_attention, pre_feedforward and post_feedforward, while Llama's
    ``post_attention_layernorm`` is the norm before the MLP.
    """

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        eps, offset = config.rms_norm_eps, config.norm_unit_offset
        self.self_attn = DecoderAttention(config, layer)
        self.mlp = GatedMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.sandwich_norm = config.sandwich_norm
        if self.sandwich_norm:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        workspace: GatherWorkspace,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, metadata, workspace)
        if self.sandwich_norm:
            x = x + self.post_attention_layernorm(attn)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """The decoder stack, named like HF's ``model.*`` so checkpoint names map directly."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_unit_offset)


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
        # RoPE tables: one per distinct (base, scaling) among the layers (Gemma 3 has two), and each layer's.
        # Plain attributes, not buffers: built on CPU even under a meta-device context, and not part of the
        # state dict; copied to each device the model runs on when first needed.
        ropes = [config.layer_rope(i) for i in range(config.num_layers)]
        distinct = {repr(rope): rope for rope in ropes}  # scaling dicts are not hashable
        keys = list(distinct)
        self._layer_rope = [keys.index(repr(rope)) for rope in ropes]
        self._inv_freq_cpu = [rope_inv_freq(config.head_dim, theta, scaling) for theta, scaling in distinct.values()]
        self._inv_freq: dict[torch.device, list[torch.Tensor]] = {}
        self._workspace = GatherWorkspace()
        # Per KV cache layout, keyed by its number of groups (mask-only: 1; hybrid: len(kv_cache_groups()), the
        # same layout when the model has one attention spec): each layer's group, and each group's windows.
        self._layouts: dict[int, tuple[tuple[int, ...], tuple[frozenset[int | None], ...]]] = {}
        for hybrid in (False, True):
            groups = config.kv_cache_groups(hybrid)
            group_of = {layer: g for g, group in enumerate(groups) for layer in group.layers}
            windows = tuple(frozenset(config.layer_window(layer) for layer in group.layers) for group in groups)
            self._layouts[len(groups)] = (tuple(group_of[i] for i in range(config.num_layers)), windows)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        """Run the step's new tokens ``[T]`` at ``positions`` ``[T]``; returns final-normed hidden ``[T, H]``.

        ``attn_metadata`` has one entry per KV cache group of the layout ``kv_caches`` was allocated for
        (``config.kv_cache_groups(hybrid)``, in that order); each layer attends with its group's. The new
        tokens' K/V are written into ``kv_caches`` (one (K, V) pair per layer) at the group's ``slot_mapping``
        before attention reads them.
        """
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(f"expected {self.config.num_layers} KV cache layers, got {len(kv_caches)}")
        layout = self._layouts.get(len(attn_metadata))
        if layout is None:
            raise ValueError(
                f"expected one attention metadata per KV cache group ({' or '.join(map(str, self._layouts))} of them), "
                f"got {len(attn_metadata)}"
            )
        group_of, windows = layout
        for group, metadata in enumerate(attn_metadata):
            if metadata.sliding_window is not None and windows[group] != {metadata.sliding_window}:
                raise ValueError(
                    f"KV cache group {group} has layers of windows {sorted(windows[group], key=str)}; its "
                    f"attention metadata gathers a window of {metadata.sliding_window}"
                )
        x = self.model.embed_tokens(input_ids)
        if self.config.embed_scale is not None:
            # Rounded to the model dtype first, as HF's Gemma does (sqrt(3072) becomes 55.5 in bfloat16).
            x = x * torch.tensor(self.config.embed_scale, dtype=torch.float32).to(x.dtype)
        ropes = self._rope(positions, x.dtype)
        for layer, kv_cache, rope, group in zip(self.model.layers, kv_caches, self._layer_rope, group_of, strict=True):
            cos, sin = ropes[rope]
            x = layer(x, cos, sin, kv_cache, attn_metadata[group], self._workspace)
        return self.model.norm(x)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """cos and signed sin (see :func:`apply_rope`) ``[T, 1, head_dim]`` of each RoPE table, computed in
        float32 from positions, then cast (HF's order of ops)."""
        inv_freqs = self._inv_freq.get(positions.device)
        if inv_freqs is None:
            inv_freqs = self._inv_freq[positions.device] = [f.to(positions.device) for f in self._inv_freq_cpu]
        out = []
        for inv_freq in inv_freqs:
            freqs = (positions[:, None].float() * inv_freq)[:, None, :]
            sin = freqs.sin().to(dtype)
            out.append((torch.cat((freqs, freqs), dim=-1).cos().to(dtype), torch.cat((-sin, sin), dim=-1)))
        return out

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` in float32 for the given hidden states (typically each request's last)."""
        # lm_head is a module of its own (or, quantized and tied, the embedding's int8 table).
        logits = F.linear(hidden, self.model.embed_tokens.weight) if self.lm_head is None else self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        groups: Sequence[KVCacheGroup] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed per-layer (K, V), each ``[num_blocks, block_size, num_kv_heads, head_dim]``.

        ``groups`` (default: one group of every layer, the mask-only layout) lay the layers out in slots: layer
        ``groups[g].layers[j]`` gets slot j's tensors, shared with the layers at slot j of the other groups (a
        block id belongs to one group at a time). Zeroed rather than empty: masked-out slots and the null
        block still enter the attention matmuls, and uninitialised memory could hold NaN/inf that would
        poison the result (0 * NaN = NaN).
        """
        param = self.model.norm.weight  # a float parameter in the model's dtype, even with quantized weights
        dtype = dtype or param.dtype
        device = device or param.device
        groups = self._check_groups(groups)
        shape = (num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)
        slots = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(max(len(group.layers) for group in groups))
        ]
        caches: list[tuple[torch.Tensor, torch.Tensor]] = [slots[0]] * self.config.num_layers
        for group in groups:
            for slot, layer in enumerate(group.layers):
                caches[layer] = slots[slot]
        return caches

    def kv_bytes_per_block(
        self, block_size: int, dtype: torch.dtype | None = None, groups: Sequence[KVCacheGroup] | None = None
    ) -> int:
        """Bytes one block of the pool takes (K and V of each slot), to size the cache from a memory budget.

        A block serves one group, so it spans the largest group's layers; with the default single group, all.
        """
        groups = self._check_groups(groups)
        itemsize = (dtype or self.model.norm.weight.dtype).itemsize
        slots = max(len(group.layers) for group in groups)
        return block_size * slots * 2 * self.config.num_kv_heads * self.config.head_dim * itemsize

    def _check_groups(self, groups: Sequence[KVCacheGroup] | None) -> Sequence[KVCacheGroup]:
        """The groups (default: the mask-only single group); ValueError unless they hold every layer once."""
        if groups is None:
            return self.config.kv_cache_groups(hybrid=False)
        layers = sorted(layer for group in groups for layer in group.layers)
        if layers != list(range(self.config.num_layers)):
            raise ValueError(f"KV cache groups must hold each of the {self.config.num_layers} layers once: {groups}")
        return groups

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
            for index, name in enumerate(self.hf_names(target))
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
    def hf_names(param_name: str) -> list[str]:
        """The HF checkpoint names stored in one of our parameters, in shard order."""
        *prefix, module, kind = param_name.split(".")
        parts = _FUSED_PARTS.get(module, (module,))
        return [".".join([*prefix, part, kind]) for part in parts]
