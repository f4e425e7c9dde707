"""Per-step metadata of the recurrent layers: which state slot each request reads and writes, and where states
are saved.

A recurrent layer (Gated DeltaNet, Mamba2, LFM2's short convolution) keeps one fixed-size state per sequence in
a slot of the state cache (``DecoderForCausalLM.allocate_state_cache``). When a step starts, slot ``slots[i]``
holds request i's state after the tokens it has already computed (the runner zeroes it for a fresh request or
copies a checkpoint into it); when the step ends it holds the state after this step's tokens too. A save
``(i, n, s)`` also leaves request i's state after the first ``n`` tokens of this step in slot ``s``: a
checkpoint taken at a block boundary inside a chunk.

Built once per step, like :class:`~prefixcache.model.attention.AttentionMetadata`, and shared by every
recurrent layer. The layers run requests with one new token (decode) as one batch, and the others one at a
time, cut at their save points (:attr:`StateMetadata.prefills`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class PrefillRun:
    """One request of the step with more than one new token: its rows in the batch and its save points."""

    # Batch rows [start, end) of the request's new tokens.
    start: int
    end: int
    slot: int
    # (tokens of this chunk after which the state is taken, slot it goes to), by increasing token count.
    saves: tuple[tuple[int, int], ...]


@dataclass(slots=True)
class StateMetadata:
    """Per step, for the recurrent layers: which state slot each request in the batch reads and writes."""

    slots: torch.Tensor  # [num_requests] long: each request's working-state slot, in batch order
    query_start_loc: torch.Tensor  # [num_requests + 1] long, as AttentionMetadata's (rows of each request)
    saves: list[tuple[int, int, int]]  # (request row, tokens of this chunk after which the state is taken, slot)
    # Derived by ``build``: the requests with more than one new token, run one at a time ...
    prefills: tuple[PrefillRun, ...] = ()
    # ... and those with exactly one, run as one batch: their batch rows and slots.
    step_rows: torch.Tensor | None = None
    step_slots: torch.Tensor | None = None
    # (working slot, save slot) of the one-token requests' saves, copied after their step.
    step_saves: tuple[tuple[int, int], ...] = field(default=())

    @classmethod
    def build(
        cls,
        slots: list[int],
        num_new_tokens: list[int],
        saves: list[tuple[int, int, int]],
        device: torch.device | str,
    ) -> StateMetadata:
        """Metadata for requests with these working slots and new-token counts; ValueError for misuse: a slot
        used twice, a save outside its request's chunk, or a save into a request's working slot."""
        if len(slots) != len(num_new_tokens):
            raise ValueError(f"{len(slots)} slots for {len(num_new_tokens)} requests")
        if any(n < 1 for n in num_new_tokens):
            raise ValueError(f"every request needs at least one new token, got {num_new_tokens}")
        if any(s < 0 for s in slots) or len(set(slots)) != len(slots):
            raise ValueError(f"working slots must be distinct and non-negative, got {slots}")
        working = set(slots)
        by_row: dict[int, list[tuple[int, int]]] = {}
        save_slots: set[int] = set()
        for row, n, slot in saves:
            if not 0 <= row < len(slots):
                raise ValueError(f"save {(row, n, slot)} names request row {row} of {len(slots)}")
            if not 0 < n <= num_new_tokens[row]:
                raise ValueError(f"save {(row, n, slot)} is outside the request's {num_new_tokens[row]} new tokens")
            if slot < 0 or slot in working or slot in save_slots:
                raise ValueError(f"save {(row, n, slot)} must go to a slot no request works in or saves to")
            save_slots.add(slot)
            by_row.setdefault(row, []).append((n, slot))
        starts = [0]
        for n in num_new_tokens:
            starts.append(starts[-1] + n)
        prefills = tuple(
            PrefillRun(starts[row], starts[row + 1], slots[row], tuple(sorted(by_row.get(row, []))))
            for row, n in enumerate(num_new_tokens)
            if n > 1
        )
        one_token = [row for row, n in enumerate(num_new_tokens) if n == 1]
        step_rows = step_slots = None
        if one_token:
            step_rows = torch.tensor([starts[row] for row in one_token], dtype=torch.long, device=device)
            step_slots = torch.tensor([slots[row] for row in one_token], dtype=torch.long, device=device)
        step_saves = tuple((slots[row], slot) for row in one_token for _, slot in by_row.get(row, []))
        return cls(
            slots=torch.tensor(slots, dtype=torch.long, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.long, device=device),
            saves=list(saves),
            prefills=prefills,
            step_rows=step_rows,
            step_slots=step_slots,
            step_saves=step_saves,
        )
