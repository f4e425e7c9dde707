"""A GGUF's own quantized weights, kept quantized: weight-only int4 / int8 matmuls instead of dequantized floats.

A decode step reads every weight once, so its speed is bounded by the bytes it reads: the GGUF's 4-bit
weights are a quarter of bfloat16's. llama.cpp's 4-bit types are affine in groups of 32 along the input
dimension, ``w = scale * q + min`` with ``q`` in 0..15 (Q4_0: ``min = -8 * scale``; Q4_1: its own min; Q4_K:
per-32 sub-block scales and mins from 6-bit codes of a 256 super-block), which is exactly torch's int4
weight-only layout, ``w = (q - 8) * scale + zero`` with ``zero = min + 8 * scale``: the integers carry over
unchanged and only the scales are rounded to bfloat16, the kernels' dtype. Every other quantized type (Q8_0,
Q6_K, Q5_*, ...) is requantized per output channel to int8 (``_weight_int8pack_mm``), which is at least as
fine as the source for the types below 8 bits; for Q8_0 the per-channel scale is the row's largest block
scale. Float tensors (norms, F16/F32 weights) stay as the model loaded them.

On a CPU with AVX-512 VNNI and prefixcache's own kernels (``native/gguf_matmul.cpp``, see :func:`gguf_ops`),
Q4_0, Q4_1, Q4_K and Q8_0 run as :class:`GGUFLinear` instead: the same integers and scales (float16) repacked
into tiles of 16 rows, times activations quantized per block of 32 to int8, with integer dot products as
llama.cpp computes them; they read the weights at close to the memory's speed where torch's kernels read a
quarter of it.

torch's kernels are CPU and CUDA ops (``_weight_int4pack_mm_for_cpu``, ``_weight_int4pack_mm``,
``_weight_int8pack_mm``): the fallback, for other devices and where the native kernels are unavailable or
built without AVX-512 VNNI (their scalar loops are slower than torch's kernels). Where one is missing for the
device the weight is dequantized once and runs as a plain matmul, so the quantized model runs anywhere the float
one does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ConcatLinear", "GGUFLinear", "Int4Linear", "Int8Linear", "QuantizedEmbedding", "quantize_from_gguf"]

from prefixcache.model.decoder import DecoderLayer, PackedDecodeLayer
from prefixcache.model.pages import huge_page_bytes

if TYPE_CHECKING:
    from prefixcache.model.decoder import DecoderForCausalLM

logger = logging.getLogger(__name__)

GROUP_SIZE = 32
# What the int4 and int8 kernels compute in: their float32 versions are reference loops, 10-20x slower.
COMPUTE_DTYPE = torch.bfloat16
# The int4 kernels need N a multiple of 16 (CPU; CUDA's 8) and K of two groups (CUDA's 2 inner K tiles of 16).
_INT4_N_MULTIPLE = 16
_INT4_K_MULTIPLE = 2 * GROUP_SIZE


@dataclass(slots=True)
class GGUFWeight:
    """One GGUF weight with HF's row order: ``[N, K]``; ``q``, ``scale``, ``minimum`` set for the 4-bit types
    (``q`` integers 0..15 ``[N, K]``, the others ``[N, K / 32]``), ``q`` (int8) and ``scale`` for Q8_0,
    ``dense`` (float32) for every type."""

    type_name: str
    dense: np.ndarray
    q: np.ndarray | None = None
    scale: np.ndarray | None = None
    minimum: np.ndarray | None = None


def _four_bit_affine(type_name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Per group of 32 ``(scale, min)`` float32 ``[num_blocks, groups per block]`` of a 4-bit block type, or None
    for another type. Byte layouts are ggml's (block_q4_0, block_q4_1, block_q4_K)."""
    import gguf.quants

    def half(start: int) -> np.ndarray:
        return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)

    if type_name == "Q4_0":
        d = half(0)
        return d, -8 * d
    if type_name == "Q4_1":
        return half(0), half(2)
    if type_name == "Q4_K":
        d, dmin = half(0), half(2)
        sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
        return d * sc.astype(np.float32), -dmin * mn.astype(np.float32)
    return None


def read_gguf_weight(tensor: object, row_order: np.ndarray | None = None) -> GGUFWeight:
    """Decode a ``gguf.ReaderTensor`` of a 2-D weight into a :class:`GGUFWeight`; ``row_order`` picks its rows
    (llama.cpp stores Llama's Q and K rows permuted for its RoPE layout)."""
    import gguf

    qtype = tensor.tensor_type  # type: ignore[attr-defined]
    raw = np.asarray(tensor.data)  # type: ignore[attr-defined]
    if row_order is not None:
        raw = raw[row_order]
    dense = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)
    rows, cols = dense.shape
    weight = GGUFWeight(qtype.name, dense)
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    affine = _four_bit_affine(qtype.name, raw.reshape(-1, type_size)) if raw.dtype == np.uint8 else None
    if qtype.name == "Q8_0":
        blocks = raw.reshape(-1, type_size)
        weight.q = blocks[:, 2:].copy().view(np.int8).reshape(rows, cols)
        weight.scale = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(rows, cols // GROUP_SIZE)
    if affine is not None:
        scale, minimum = (a.reshape(rows, cols // GROUP_SIZE) for a in affine)
        step = np.repeat(scale, GROUP_SIZE, axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(step == 0, 0, np.rint((dense - np.repeat(minimum, GROUP_SIZE, axis=1)) / step))
        weight.q, weight.scale, weight.minimum = np.clip(q, 0, 15).astype(np.uint8), scale, minimum
    return weight


@cache
def _kernel_works(kind: str, device: torch.device) -> bool:
    """Whether torch has the ``int4`` / ``int8`` weight-only kernel for ``device`` (tried once on a tiny weight)."""
    try:
        if kind == "int4":
            layer = Int4Linear(
                torch.zeros(_INT4_N_MULTIPLE, _INT4_K_MULTIPLE, dtype=torch.uint8),
                torch.ones(_INT4_N_MULTIPLE, 2),
                torch.zeros(_INT4_N_MULTIPLE, 2),
                None,
                device,
                probe=False,
            )
        else:
            layer = Int8Linear(torch.ones(8, 32, dtype=torch.int8), torch.ones(8), None, device, probe=False)
        layer(torch.ones(1, layer.in_features, device=device))
    except (RuntimeError, NotImplementedError) as exc:
        logger.info("no %s weight-only kernel on %s (%s): those weights run dequantized", kind, device, exc)
        return False
    return True


class _WeightOnlyLinear(nn.Module):
    """What the quantized linear layers share: their shape, and a float bias on the weights' device."""

    def __init__(self, shape: torch.Size, bias: torch.Tensor | None, device: torch.device) -> None:
        super().__init__()
        self.out_features, self.in_features = shape
        self.bias = None if bias is None else nn.Parameter(bias.to(device), requires_grad=False)
        self._matmul: Callable[[torch.Tensor], torch.Tensor]  # ``[M, K]`` in COMPUTE_DTYPE -> ``[M, N]``, no bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == COMPUTE_DTYPE and x.dim() == 2 and self.bias is None:
            return self._matmul(x)  # the decoder's case: no reshapes or casts to dispatch
        shape = x.shape
        out = self._matmul(x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*shape[:-1], self.out_features)


class Int4Linear(_WeightOnlyLinear):
    """Weight-only int4 linear layer, groups of 32 along the input: ``y = x @ ((q - 8) * scale + zero).T + b``.

    ``q`` ``[N, K]`` holds integers 0..15, ``scale`` and ``minimum`` ``[N, K / 32]`` (``w = scale * q + min``).
    Where torch has no int4 kernel for ``device`` the dequantized weight is kept instead.
    """

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        minimum: torch.Tensor,
        bias: torch.Tensor | None,
        device: torch.device | str,
        probe: bool = True,
    ) -> None:
        device = torch.device(device)
        super().__init__(q.shape, bias, device)
        zero = minimum + 8 * scale
        if probe and not _kernel_works("int4", device):
            dense = scale.repeat_interleave(GROUP_SIZE, 1) * q.float() + minimum.repeat_interleave(GROUP_SIZE, 1)
            self.register_buffer("dense", dense.to(device=device, dtype=COMPUTE_DTYPE))
            self._matmul = lambda x: F.linear(x, self.dense)
            return
        # [K / 32, N, 2]: each group's scale and zero, the layout both kernels take.
        scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(device=device, dtype=COMPUTE_DTYPE))
        if device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
            kernel = torch.ops.aten._weight_int4pack_mm_for_cpu
        else:
            nibbles = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(nibbles.to(device), 2)
            kernel = torch.ops.aten._weight_int4pack_mm
        self.register_buffer("packed", packed.to(device))
        self._matmul = lambda x: kernel(x, self.packed, GROUP_SIZE, self.scales_and_zeros)


class Int8Linear(_WeightOnlyLinear):
    """Weight-only int8 linear layer with one scale per output channel: ``y = (x @ q.T) * scale + b``.

    Also an embedding (:meth:`rows`), so a tied embedding and its output projection share one int8 copy.
    """

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        device: torch.device | str,
        probe: bool = True,
    ) -> None:
        device = torch.device(device)
        super().__init__(q.shape, bias, device)
        self.register_buffer("q", q.to(device))
        self.register_buffer("scale", scale.to(device=device, dtype=COMPUTE_DTYPE))
        if not probe or _kernel_works("int8", device):
            self._matmul = lambda x: torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)
        else:
            self._matmul = lambda x: F.linear(x, self.q.to(COMPUTE_DTYPE)) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and x.dim() == 2 and x.shape[0] == 1 and self.bias is None:
            # One row, compiled: inductor fuses the dequantization into one pass over the int8 rows, about twice
            # as fast as the kernel (which wins from a few rows on); bfloat16 times int8 is exact in float32.
            return ((x.float()[:, None, :] * self.q.float()).sum(-1) * self.scale.float()).to(x.dtype)
        return super().forward(x)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized rows ``ids`` (an embedding lookup), in ``dtype``."""
        return (self.q[ids].to(torch.float32) * self.scale[ids, None].float()).to(dtype)


TILE_ROWS = 16  # output rows a tile of GGUFLinear's packed weights interleaves (one 512-bit lane each)
_NATIVE_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")


@cache
def gguf_ops() -> object | None:
    """``torch.ops.prefixcache`` with the GGUF matmul kernels (their fake implementations registered, so a
    compiled step traces them as opaque ops), or None where the native kernels are unavailable or built without
    AVX-512 VNNI."""
    from prefixcache.model.native import native_ops

    ops = native_ops()
    if ops is None or not hasattr(ops, "gguf_q4_matmul") or not _vector_kernels(ops):
        return None
    for name in ("gguf_q4_matmul", "gguf_q8_matmul"):
        torch.library.register_fake(f"prefixcache::{name}")(_fake_gguf_matmul)
    return ops


def _vector_kernels(ops: object) -> bool:
    """Whether ``ops``' GGUF kernels were built with AVX-512 VNNI; their portable scalar loops are slower than
    torch's int4 / int8 kernels, which then run the GGUF's weights instead (logged once)."""
    isa = ops.gguf_matmul_isa()  # type: ignore[attr-defined]
    if isa == "avx512-vnni":
        return True
    logger.info(
        "prefixcache's GGUF kernels are built for %s loops on this CPU (no AVX-512 VNNI), slower than torch's "
        "int4 / int8 weight-only kernels: those run the GGUF's weights",
        isa,
    )
    return False


def _runs_natively(device: torch.device | str) -> bool:
    return torch.device(device).type == "cpu" and gguf_ops() is not None


def _fake_gguf_matmul(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)


def _tiles(array: np.ndarray, lane_bytes: int) -> np.ndarray:
    """``[N, K / 32, lane_bytes * chunks]`` per-row block bytes as ``[N / 16, K / 32, chunks, 16, lane_bytes]``
    -> ``[N / 16, K / 32, chunks * 16 * lane_bytes]``: each chunk's bytes of the tile's 16 rows side by side."""
    rows, blocks, width = array.shape
    tiled = array.reshape(rows // TILE_ROWS, TILE_ROWS, blocks, width // lane_bytes, lane_bytes)
    return tiled.transpose(0, 2, 3, 1, 4).reshape(rows // TILE_ROWS, blocks, -1)


def pack_gguf_weight(q: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None) -> torch.Tensor:
    """A Q4_* (``q`` 0..15, ``minimum`` given) or Q8_0 (``q`` int8, no ``minimum``) ``[N, K]`` weight in the
    tiles ``native/gguf_matmul.cpp`` reads: uint8 ``[ceil(N / 16), K / 32, 320 or 544]``, rows past N zero."""
    rows, cols = q.shape
    padded = -(-rows // TILE_ROWS) * TILE_ROWS

    def pad(a: np.ndarray) -> np.ndarray:
        return np.pad(a, ((0, padded - rows), (0, 0)))

    def halves(a: np.ndarray) -> np.ndarray:  # float16 per row and block: [N / 16, K / 32, 16 * 2 bytes]
        return _tiles(pad(a).astype(np.float16).view(np.uint8).reshape(padded, -1, 2), 2)

    blocks = pad(q).reshape(padded, cols // GROUP_SIZE, GROUP_SIZE)
    if minimum is None:
        parts = [_tiles(blocks.view(np.uint8), 4), halves(scale)]
    else:  # byte i of a block: q[i] in its low nibble, q[i + 16] in its high one (the GGUF's Q4_0 order)
        nibbles = blocks[:, :, :16].astype(np.uint8) | blocks[:, :, 16:].astype(np.uint8) << 4
        parts = [_tiles(nibbles, 4), halves(scale), halves(minimum)]
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=2)))


class GGUFLinear(nn.Module):
    """A linear layer over a GGUF's block-quantized weight with prefixcache's CPU kernels (:func:`gguf_ops`):
    ``y = x @ w.T + b``, ``w = scale * q + minimum`` per block of 32 (Q4_0, Q4_1, Q4_K) or ``scale * q`` (Q8_0),
    the activations quantized per block to int8 inside the kernel. Any float dtype in, the same dtype out.

    Also an embedding (:meth:`rows`), so a tied Q8_0 embedding and its output projection share one copy.
    """

    def __init__(self, q: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None, bias: torch.Tensor | None) -> None:
        super().__init__()
        ops = gguf_ops()
        if ops is None:
            raise RuntimeError("GGUFLinear needs prefixcache's native CPU kernels, which are unavailable here")
        self.out_features, self.in_features = q.shape
        self.four_bit = minimum is not None
        # the op itself, not its packet: one dispatch lookup less a call (a decode step makes 211)
        self._matmul = (ops.gguf_q4_matmul if self.four_bit else ops.gguf_q8_matmul).default  # type: ignore[attr-defined]
        self.register_buffer("packed", pack_gguf_weight(q, scale, minimum))
        self.bias = None if bias is None else nn.Parameter(bias.detach().cpu(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self._buffers["packed"]  # a dict lookup: ``self.packed`` goes through nn.Module.__getattr__
        if x.dim() == 2 and self.bias is None:
            return self._matmul(x, packed, self.out_features)  # the decoder's case
        out = self._matmul(x.reshape(-1, self.in_features), packed, self.out_features)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    # Called straight, without nn.Module.__call__'s hook machinery: a one-tile call took 3.1-5.3 us through it and
    # 2.1-2.3 us straight (the op itself 1.8; best and median, load average 5), and a decode step makes 211. No
    # forward hooks are ever registered on these layers (they would be skipped); torch.compile traces the call as
    # it does any module's.
    __call__ = forward

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized rows ``ids`` of a Q8_0 weight (an embedding lookup), in ``dtype``."""
        if self.four_bit:
            raise TypeError("rows() reads a Q8_0 table; this layer holds 4-bit weights")
        flat = ids.reshape(-1)
        count, blocks = flat.numel(), self.in_features // GROUP_SIZE
        tiles = self.packed[flat // TILE_ROWS]  # [n, K / 32, 544]
        lane, picked = flat % TILE_ROWS, torch.arange(count)
        q = tiles[..., : 32 * TILE_ROWS].view(count, blocks, 8, TILE_ROWS, 4)[picked, :, :, lane]
        scale = tiles[..., 32 * TILE_ROWS :].contiguous().view(torch.float16)[picked, :, lane]
        dense = q.view(torch.int8).float().view(count, blocks, GROUP_SIZE) * scale.float()[..., None]
        return dense.view(*ids.shape, self.in_features).to(dtype)


class ConcatLinear(nn.Module):
    """Several linear layers whose outputs are concatenated: a fused projection (QKV, gate-up) whose parts the
    GGUF stores in types that cannot share one kernel (Q4_K_M keeps some V and down weights in Q6_K)."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.out_features = sum(p.out_features for p in parts)  # type: ignore[misc]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


class QuantizedEmbedding(nn.Module):
    """An embedding looked up from an :class:`Int8Linear` or a Q8_0 :class:`GGUFLinear` (shared with the output
    projection when tied)."""

    def __init__(self, table: Int8Linear | GGUFLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids, self.dtype)


def int8_per_channel(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of a float32 ``[N, K]``: ``(q, scale)`` with ``dense ~= q * scale[:, None]``."""
    scale = dense.abs().amax(dim=1) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round(dense / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def build_linear(parts: Sequence[GGUFWeight], bias: torch.Tensor | None, device: torch.device | str) -> nn.Module:
    """One module for the row-wise concatenation of ``parts`` (a fused projection's pieces, in order).

    On a CPU with the native kernels (:func:`gguf_ops`), parts all of one type family (4-bit: Q4_0, Q4_1, Q4_K;
    or Q8_0) become one :class:`GGUFLinear`, and a mix is a :class:`ConcatLinear` of each part's own module.
    Otherwise, all 4-bit with shapes the int4 kernel takes: one :class:`Int4Linear`; else a part that is 4-bit
    stays int4 on its own and the rest become int8, concatenated by :class:`ConcatLinear`.
    """
    if _runs_natively(device):
        native = _native_linear(parts, bias)
        if native is not None:
            return native

    def int4_ok(w: GGUFWeight) -> bool:
        return w.minimum is not None and w.q.shape[0] % _INT4_N_MULTIPLE == 0 and w.q.shape[1] % _INT4_K_MULTIPLE == 0

    def as_tensor(arrays: list[np.ndarray]) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(arrays, axis=0))

    if all(int4_ok(w) for w in parts):
        return Int4Linear(
            as_tensor([w.q for w in parts]),  # type: ignore[misc]
            as_tensor([w.scale for w in parts]),  # type: ignore[misc]
            as_tensor([w.minimum for w in parts]),  # type: ignore[misc]
            bias,
            device,
        )
    if not any(int4_ok(w) for w in parts):
        return Int8Linear(*int8_per_channel(as_tensor([w.dense for w in parts])), bias, device)
    biases = [None] * len(parts) if bias is None else list(bias.split([w.dense.shape[0] for w in parts]))
    return ConcatLinear([build_linear([w], b, device) for w, b in zip(parts, biases, strict=True)])


def _native_linear(parts: Sequence[GGUFWeight], bias: torch.Tensor | None) -> nn.Module | None:
    """:class:`GGUFLinear` for ``parts`` of one family, a :class:`ConcatLinear` of each part's module for a
    mix, or None if none can run natively (those types take the torch kernels)."""
    families = [("q4" if w.minimum is not None else "q8") if w.type_name in _NATIVE_TYPES else None for w in parts]
    if families[0] is not None and len(set(families)) == 1:
        q = np.concatenate([w.q for w in parts])  # type: ignore[misc]
        scale = np.concatenate([w.scale for w in parts])  # type: ignore[misc]
        minimum = np.concatenate([w.minimum for w in parts]) if families[0] == "q4" else None  # type: ignore[misc]
        return GGUFLinear(q, scale, minimum, bias)
    if all(family is None for family in families):
        return None
    biases = [None] * len(parts) if bias is None else list(bias.split([w.dense.shape[0] for w in parts]))
    return ConcatLinear([build_linear([w], b, "cpu") for w, b in zip(parts, biases, strict=True)])


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each tensor's bytes counted once (a tied table is shared; the
    packed GGUF weights are slices of one region, :func:`gather_packed_weights`); a oneDNN packed weight
    (:class:`~prefixcache.model.cpu_linear.OneDNNLinear`, no storage of its own) by its own size."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_mkldnn:
            total += torch.ops.mkldnn._nbytes(tensor)
            continue
        extent = (tensor.data_ptr(), tensor.nbytes)
        if extent not in seen:
            seen.add(extent)
            total += tensor.nbytes
    return total


def gather_packed_weights(model: nn.Module) -> None:
    """Move the packed tiles of every :class:`GGUFLinear` of ``model`` into one region of huge pages
    (:func:`huge_page_bytes`), each tile row 64-byte aligned as before.

    A decode step streams all of them (SmolLM2's 96 MB); in 4 KiB pages every page is a TLB miss, and in a virtual
    machine each miss is a two-level page walk. One product's tiles are 0.2-1.1 MB, too small for a 2 MiB page of
    their own, hence one region for all. SmolLM2's 120 q4 products and Q8_0 head, in a loop as a decode step reads
    them (2 threads): 5.02 against 4.55 ms, the q4 products 3.93 against 3.51.
    """
    linears = [m for m in model.modules() if isinstance(m, GGUFLinear)]  # a tied table once
    sizes = [-(-m._buffers["packed"].numel() // 64) * 64 for m in linears]
    region = huge_page_bytes(sum(sizes))
    start = 0
    for linear, size in zip(linears, sizes, strict=True):
        packed = linear._buffers["packed"]
        moved = region[start : start + packed.numel()].view(packed.shape)
        moved.copy_(packed)
        linear._buffers["packed"] = moved
        start += size


def quantize_from_gguf(model: DecoderForCausalLM, gguf_path: Path, device: torch.device | str) -> None:
    """Replace ``model``'s linear layers and embedding by the GGUF's quantized weights (in place).

    The model must hold the same weights, loaded from this GGUF's conversion: its biases stay, and its float
    weights are dropped as each module is replaced. Rows come in HF's order (llama.cpp permutes Llama's Q and
    K rows, as transformers' converter undoes).
    """
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    field = reader.fields["general.architecture"]
    architecture = bytes(field.parts[field.data[0]]).decode()
    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture)
    names = gguf.get_tensor_name_map(arch_id, model.config.num_layers)
    tensors = {t.name: t for t in reader.tensors}
    quantized = {name for name, t in tensors.items() if t.tensor_type.name not in _FLOAT_TYPES}
    config = model.config

    def gguf_name(hf_name: str) -> str:
        base = names.get_name(hf_name.removesuffix(".weight"))
        if base is None or f"{base}.weight" not in tensors:
            raise ValueError(f"{gguf_path} has no tensor for {hf_name}")
        return f"{base}.weight"

    def row_order(name: str, rows: int) -> np.ndarray | None:
        heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}.get(name.split(".")[-2])
        if architecture != "llama" or heads is None:
            return None
        return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(rows)

    def weight(hf_name: str) -> GGUFWeight:
        name = gguf_name(hf_name)
        return read_gguf_weight(tensors[name], row_order(name, int(tensors[name].shape[-1])))

    modules = dict(model.named_modules())
    for path, module in modules.items():
        if not isinstance(module, nn.Linear):
            continue
        hf_names = model.hf_names(f"{path}.weight")
        if not all(gguf_name(n) in quantized for n in hf_names):
            continue  # a float weight keeps its float module
        replacement = build_linear([weight(n) for n in hf_names], module.bias, device)
        parent, _, child = path.rpartition(".")
        setattr(modules[parent] if parent else model, child, replacement)
    embed_name = gguf_name("model.embed_tokens.weight")
    if embed_name in quantized:
        dtype = model.model.norm.weight.dtype
        embed = weight("model.embed_tokens.weight")
        table: Int8Linear | GGUFLinear
        if embed.type_name == "Q8_0" and _runs_natively(device):
            table = GGUFLinear(embed.q, embed.scale, None, None)  # type: ignore[arg-type]
        else:
            table = Int8Linear(*int8_per_channel(torch.from_numpy(embed.dense)), None, device)
        model.model.embed_tokens = QuantizedEmbedding(table, dtype)
        if model.lm_head is None:
            model.lm_head = table  # tied: the output projection reads the same int8 table
    gather_packed_weights(model)
    for layer in model.model.layers:
        layer.packed_decode = packed_decode_layer(layer)


def packed_decode_layer(layer: DecoderLayer) -> PackedDecodeLayer | None:
    """The layer's products as ``gguf_decode_layer_`` takes them, where the layer is one it computes and all four
    of its products are :class:`GGUFLinear` without a bias; else None (the layer's modules run)."""
    if not layer.computes_as_packed_decode():
        return None
    products = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    if not all(isinstance(p, GGUFLinear) and p.bias is None for p in products):
        return None
    weights = tuple(p._buffers["packed"] for p in products)
    return PackedDecodeLayer(weights, tuple(p.out_features for p in products))  # type: ignore[arg-type]


_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
