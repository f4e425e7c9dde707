"""The recurrent layers of hybrid models, in pure PyTorch: Gated DeltaNet (Qwen3.5), Mamba2 (Granite 4.0-H) and
LFM2's gated short convolution.

Each keeps a fixed-size state per sequence in a slot of the state cache (slot-major tensors shaped by
``ModelConfig.state_shapes``): the window of its causal depthwise convolution (the last ``kernel - 1`` inputs,
token-major) and, for Gated DeltaNet and Mamba2, one matrix per head, in float32 at least (``state_dtype``;
transformers keeps it in float32 too: a bfloat16 matrix state would drift over a long sequence). The recurrences
compute in that dtype.
:class:`~prefixcache.model.state.StateMetadata` says which slot each request reads and writes and where states
are saved.

Requests with one new token (decode) run as one batch with the one-step recurrence; requests with more run
one at a time with the chunked form, cut at their save points so that the state after exactly ``n`` tokens
can be copied out. The math follows transformers' torch implementations (the chunked gated delta rule with
its triangular solve per chunk; Mamba2's state space duality), which the tests compare against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from prefixcache.model.config import GatedDeltaNetSpec, Mamba2Spec, ModelConfig, ShortConvSpec
from prefixcache.model.state import StateMetadata

# Tokens per chunk of the chunked gated delta rule (transformers' and FLA's default).
_GDN_CHUNK = 64
_L2NORM_EPS = 1e-6

Recurrence = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the matrix states and of the recurrences for a model in ``dtype``: float32 at least."""
    return torch.promote_types(dtype, torch.float32)


def causal_conv(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    meta: StateMetadata,
) -> torch.Tensor:
    """Depthwise causal convolution of ``x`` ``[T, C]`` (weight ``[C, 1, K]``) continuing each request's window
    in ``conv_state`` ``[slots, K - 1, C]`` (its last inputs, token-major like ``x``), which is advanced (and
    saved) in place.

    Computed as K shifted multiply-adds over token-major rows rather than with ``conv1d``: the same sums, and
    several times faster on a CPU for a kernel of 3 or 4 over thousands of channels.
    """
    taps = weight[:, 0, :].T.contiguous()  # [K, C], each tap a contiguous row (strided ones broadcast slower)
    keep = taps.shape[0] - 1
    out = torch.empty_like(x)
    for run in meta.prefills:
        window = torch.cat([conv_state[run.slot], x[run.start : run.end]])  # [K - 1 + L, C]
        out[run.start : run.end] = _shifted_sum(window, taps, bias)
        for n, save_slot in run.saves:
            conv_state[save_slot] = window[n : n + keep]
        conv_state[run.slot] = window[-keep:]
    if meta.step_rows is not None:
        window = torch.cat([conv_state[meta.step_slots], x[meta.step_rows][:, None]], dim=1)  # [B, K, C]
        out[meta.step_rows] = _shifted_sum(window.transpose(0, 1), taps, bias)[0]
        conv_state.index_copy_(0, meta.step_slots, window[:, 1:])
        for slot, save_slot in meta.step_saves:
            conv_state[save_slot] = conv_state[slot]
    return out


def _shifted_sum(window: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``out[t] = bias + sum_j taps[j] * window[t + j]`` over the first dim: ``window`` ``[K - 1 + L, ...]``
    gives ``[L, ...]`` (the taps broadcast over the last dim, the channels)."""
    kernel = taps.shape[0]
    length = window.shape[0] - kernel + 1
    out = window[:length] * taps[0] if bias is None else torch.addcmul(bias, window[:length], taps[0])
    for j in range(1, kernel):
        out.addcmul_(window[j : j + length], taps[j])
    return out


def run_recurrence(
    meta: StateMetadata,
    state: torch.Tensor,
    inputs: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    chunked: Recurrence,
    step: Recurrence,
) -> torch.Tensor:
    """Run a matrix-state recurrence over the step's tokens, filling ``out`` (rows as ``inputs``).

    ``chunked(*inputs_of_a_run, state) -> (out, state)`` runs one request's tokens from its state;
    ``step(*inputs_of_rows, states) -> (out, states)`` one token of a batch of requests, advancing the gathered
    copy of their states in place. A request's tokens are cut at its save points, so the state after exactly n
    tokens is at hand for the save.
    """
    for run in meta.prefills:
        current, start = state[run.slot], run.start
        for n, save_slot in (*run.saves, (run.end - run.start, None)):
            end = run.start + n
            if end > start:
                out[start:end], current = chunked(*(t[start:end] for t in inputs), current)
            if save_slot is not None:
                state[save_slot] = current
            start = end
        state[run.slot] = current
    if meta.step_rows is not None:
        out[meta.step_rows], advanced = step(*(t[meta.step_rows] for t in inputs), state[meta.step_slots])
        state.index_copy_(0, meta.step_slots, advanced)
        for slot, save_slot in meta.step_saves:
            state[save_slot] = state[slot]
    return out


def _chunk_views(chunk: int, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """``[L, H, ...]`` tensors as ``[H, num_chunks, chunk, ...]``, zero-padded to whole chunks (a padded
    token has zero key, value and decay, so it changes neither the outputs kept nor the state)."""
    length = tensors[0].shape[0]
    pad = -length % chunk
    views = []
    for t in tensors:
        t = t.movedim(0, 1)
        if pad:
            t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        views.append(t.reshape(t.shape[0], -1, chunk, *t.shape[2:]))
    return views


def _decay_matrices(log_decay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Within each chunk of ``log_decay`` ``[H, n, C]``: the cumulative log decay ``[H, n, C]`` and the causal
    pairwise decay ``exp(cum_i - cum_j)`` for ``j <= i`` (0 above the diagonal) ``[H, n, C, C]``."""
    cum = log_decay.cumsum(-1)
    size = cum.shape[-1]
    causal = torch.ones(size, size, dtype=torch.bool, device=cum.device).tril()
    pairwise = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    return cum, pairwise


def _chunk_terms(
    q: torch.Tensor, k: torch.Tensor, cum: torch.Tensor, pairwise: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What both chunked recurrences take of each chunk: the queries' decayed causal scores against its keys, each
    query decayed from the chunk's start (it reads the state there), each key decayed to the chunk's end (it writes
    the state there), and the whole chunk's decay of the state."""
    intra = (q @ k.transpose(-1, -2)) * pairwise
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    return intra, q_decayed, k_to_end, chunk_decay


def gated_delta_rule_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, chunk by chunk (float32).

    ``q``, ``k`` ``[L, H, Dk]`` (normalised, q scaled), ``v`` ``[L, H, Dv]``, log decay ``g`` and ``beta``
    ``[L, H]``, ``state`` ``[H, Dk, Dv]``. Per token: ``S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q``.
    Inside a chunk the delta updates are folded into one triangular solve (the UT transform), so the scan
    runs once per chunk instead of once per token.
    """
    length = q.shape[0]
    q, k, v, g, beta = _chunk_views(min(_GDN_CHUNK, length), q, k, v, g, beta)
    cum, pairwise = _decay_matrices(g)
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pairwise  # its strictly lower part; the diagonal is taken as 1
    new_values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    state_reads = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra, q_decayed, k_to_end, chunk_decay = _chunk_terms(q, k, cum, pairwise)
    out = torch.empty_like(v)
    for c in range(q.shape[1]):
        corrected = new_values[:, c] - state_reads[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + intra[:, c] @ corrected
        state = state * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ corrected
    return out.reshape(out.shape[0], -1, out.shape[-1])[:, :length].movedim(1, 0), state


def gated_delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for a batch: ``q``, ``k`` ``[B, H, Dk]``, ``v`` ``[B, H, Dv]``, ``g``,
    ``beta`` ``[B, H]``; ``state`` ``[B, H, Dk, Dv]`` (the batch's own copy) is advanced in place.

    Decode is bound by the state's memory traffic, so it is read once for both products it needs
    (``S^T k`` and ``S^T q``) and written twice (decay, then the rank-one update), with the output taken from
    those reads: ``o = S'^T q = exp(g) S^T q + (k . q) delta``.
    """
    decay = g.exp()[..., None]
    reads = state.transpose(-1, -2) @ torch.stack((k, q), dim=-1)  # [B, H, Dv, 2]
    delta = (v - decay * reads[..., 0]) * beta[..., None]
    out = decay * reads[..., 1] + (k * q).sum(-1, keepdim=True) * delta
    _decay_and_add_outer(state, decay, k, delta)
    return out, state


def _decay_and_add_outer(state: torch.Tensor, decay: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``state = decay * state + k v^T`` per batch row and head, in place (``state`` ``[B, H, K, V]``)."""
    state.mul_(decay[..., None])
    size_k, size_v = state.shape[-2:]
    state.view(-1, size_k, size_v).baddbmm_(k.reshape(-1, size_k, 1), v.reshape(-1, 1, size_v))


def decayed_linear_attention_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor, state: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's scan (state space duality) over one sequence, chunk by chunk (float32).

    ``q`` = C, ``k`` = B ``[L, H, N]``, ``v`` = dt * x ``[L, H, P]``, ``log_decay`` = dt * A ``[L, H]``,
    ``state`` ``[H, N, P]``. Per token: ``S = exp(log_decay) S + k v^T; y = S^T q``.
    """
    length = q.shape[0]
    q, k, v, log_decay = _chunk_views(min(chunk, length), q, k, v, log_decay)
    cum, pairwise = _decay_matrices(log_decay)
    intra, q_decayed, k_to_end, chunk_decay = _chunk_terms(q, k, cum, pairwise)
    out = torch.empty_like(v)
    for c in range(q.shape[1]):
        out[:, c] = q_decayed[:, c] @ state + intra[:, c] @ v[:, c]
        state = state * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ v[:, c]
    return out.reshape(out.shape[0], -1, out.shape[-1])[:, :length].movedim(1, 0), state


def decayed_linear_attention_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of Mamba2's scan for a batch: ``q``, ``k`` ``[B, H, N]``, ``v`` ``[B, H, P]``; ``state``
    ``[B, H, N, P]`` (the batch's own copy) is advanced in place: ``y = exp(a) S^T q + (k . q) v``."""
    decay = log_decay.exp()[..., None]
    out = decay * (state.transpose(-1, -2) @ q[..., None])[..., 0] + (k * q).sum(-1, keepdim=True) * v
    _decay_and_add_outer(state, decay, k, v)
    return out, state


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _L2NORM_EPS)


class GatedRMSNorm(nn.Module):
    """RMSNorm whose output is gated by ``silu(gate)``, in float32.

    Gated DeltaNet norms each head, then gates (``gate_first=False``); Mamba2 gates first, then norms each of
    ``num_groups`` groups of channels.
    """

    def __init__(self, size: int, eps: float, gate_first: bool, num_groups: int = 1) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.gate_first = gate_first
        self.num_groups = num_groups

    def forward(self, x: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        x32 = x.float()
        if self.gate_first:
            x32 = x32 * F.silu(gate.float())
        grouped = x32.unflatten(-1, (self.num_groups, -1))
        normed = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        out = self.weight * normed.to(dtype)
        if self.gate_first:
            return out
        return (out * F.silu(gate.float())).to(dtype)


def _depthwise_conv(channels: int, kernel: int, bias: bool) -> nn.Conv1d:
    """Holds a causal conv's weight ``[C, 1, K]`` (and bias) under transformers' names; run by ``causal_conv``."""
    return nn.Conv1d(channels, channels, kernel, groups=channels, bias=bias, padding=kernel - 1)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear attention layer; its four input projections (qkv, z, b, a) are fused into one matmul."""

    def __init__(self, config: ModelConfig, spec: GatedDeltaNetSpec) -> None:
        super().__init__()
        self.spec = spec
        self.key_dim = spec.num_k_heads * spec.head_k_dim
        self.value_dim = spec.num_v_heads * spec.head_v_dim
        self.split_sizes = [spec.conv_channels, self.value_dim, spec.num_v_heads, spec.num_v_heads]
        self.in_proj_qkvzba = nn.Linear(config.hidden_size, sum(self.split_sizes), bias=False)
        self.conv1d = _depthwise_conv(spec.conv_channels, spec.conv_kernel, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(spec.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(spec.num_v_heads))
        self.norm = GatedRMSNorm(spec.head_v_dim, config.rms_norm_eps, gate_first=False)
        self.out_proj = nn.Linear(self.value_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], meta: StateMetadata) -> torch.Tensor:
        spec, num_tokens = self.spec, x.shape[0]
        qkv, z, b, a = self.in_proj_qkvzba(x).split(self.split_sizes, dim=-1)
        qkv = F.silu(causal_conv(qkv, state[0], self.conv1d.weight, None, meta))
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        repeat, acc = spec.num_v_heads // spec.num_k_heads, state_dtype(x.dtype)
        q = _l2norm(q.to(acc).view(num_tokens, spec.num_k_heads, spec.head_k_dim)) * spec.head_k_dim**-0.5
        k = _l2norm(k.to(acc).view(num_tokens, spec.num_k_heads, spec.head_k_dim))
        if repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
        v = v.to(acc).view(num_tokens, spec.num_v_heads, spec.head_v_dim)
        beta = b.sigmoid().to(acc)
        g = -self.A_log.to(acc).exp() * F.softplus(a.to(acc) + self.dt_bias)
        out = torch.empty_like(v)
        run_recurrence(meta, state[1], (q, k, v, g, beta), out, gated_delta_rule_chunked, gated_delta_rule_step)
        out = self.norm(out.to(x.dtype), z.view(num_tokens, spec.num_v_heads, spec.head_v_dim), x.dtype)
        return self.out_proj(out.reshape(num_tokens, self.value_dim))


class Mamba2Mixer(nn.Module):
    """A Mamba2 layer as Granite 4.0-H has it: in_proj to (gate, x·B·C, dt), causal conv, SSD scan, gated norm."""

    def __init__(self, config: ModelConfig, spec: Mamba2Spec) -> None:
        super().__init__()
        self.spec = spec
        self.split_sizes = [spec.inner_size, spec.conv_channels, spec.num_heads]
        group_width = spec.num_groups * spec.state_size
        self.conv_split = [spec.inner_size, group_width, group_width]
        self.in_proj = nn.Linear(config.hidden_size, sum(self.split_sizes), bias=spec.proj_bias)
        self.conv1d = _depthwise_conv(spec.conv_channels, spec.conv_kernel, bias=spec.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(spec.num_heads))
        self.A_log = nn.Parameter(torch.zeros(spec.num_heads))
        self.D = nn.Parameter(torch.ones(spec.num_heads))
        self.norm = GatedRMSNorm(spec.inner_size, config.rms_norm_eps, gate_first=True, num_groups=spec.num_groups)
        self.out_proj = nn.Linear(spec.inner_size, config.hidden_size, bias=spec.proj_bias)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], meta: StateMetadata) -> torch.Tensor:
        spec, num_tokens = self.spec, x.shape[0]
        gate, xbc, dt = self.in_proj(x).split(self.split_sizes, dim=-1)
        xbc = F.silu(causal_conv(xbc, state[0], self.conv1d.weight, self.conv1d.bias, meta))
        xs, b, c = xbc.split(self.conv_split, dim=-1)
        repeat, acc = spec.num_heads // spec.num_groups, state_dtype(x.dtype)
        xs = xs.to(acc).view(num_tokens, spec.num_heads, spec.head_dim)
        b = b.to(acc).view(num_tokens, spec.num_groups, spec.state_size).repeat_interleave(repeat, dim=1)
        c = c.to(acc).view(num_tokens, spec.num_groups, spec.state_size).repeat_interleave(repeat, dim=1)
        dt = F.softplus(dt.to(acc) + self.dt_bias.to(acc)).clamp(spec.time_step_min, spec.time_step_max)
        log_decay = dt * -self.A_log.to(acc).exp()
        out = torch.empty_like(xs)

        def chunked(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return decayed_linear_attention_chunked(*args, chunk=spec.chunk_size)

        run_recurrence(
            meta, state[1], (c, b, xs * dt[..., None], log_decay), out, chunked, decayed_linear_attention_step
        )
        out = out + self.D.to(acc)[:, None] * xs
        out = self.norm(out.reshape(num_tokens, spec.inner_size), gate, x.dtype)
        return self.out_proj(out)


class ShortConv(nn.Module):
    """LFM2's gated short convolution: ``out_proj(C * conv(B * x))`` with B, C, x from one projection."""

    def __init__(self, config: ModelConfig, spec: ShortConvSpec) -> None:
        super().__init__()
        self.spec = spec
        self.in_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=spec.bias)
        self.conv = _depthwise_conv(config.hidden_size, spec.conv_kernel, bias=spec.bias)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=spec.bias)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], meta: StateMetadata) -> torch.Tensor:
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        return self.out_proj(c * causal_conv(b * h, state[0], self.conv.weight, self.conv.bias, meta))


def build_recurrent_layer(config: ModelConfig, layer: int) -> GatedDeltaNet | Mamba2Mixer | ShortConv:
    """The recurrent mixer of ``layer`` (one of ``config.state_layers``)."""
    kind = config.layer_types[layer]
    if kind == "gated_delta_net" and config.gated_delta_net is not None:
        return GatedDeltaNet(config, config.gated_delta_net)
    if kind == "mamba2" and config.mamba2 is not None:
        return Mamba2Mixer(config, config.mamba2)
    if kind == "short_conv" and config.short_conv is not None:
        return ShortConv(config, config.short_conv)
    raise ValueError(f"layer {layer} ({kind}) is not a recurrent layer")


# The module name each recurrent kind has in transformers' checkpoints (and so in ours).
RECURRENT_MODULE_NAMES = {"gated_delta_net": "linear_attn", "mamba2": "mamba", "short_conv": "conv"}
