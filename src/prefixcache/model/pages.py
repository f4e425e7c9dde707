"""Memory that the OS may back with 2 MiB pages, for what a decode step streams through every step: the packed
GGUF weights and the K/V pool. In 4 KiB pages each page of them is a TLB miss a step, and in a virtual machine
each miss is a two-level page walk (docs/architecture.md, *One call a layer, and the weights in huge pages*)."""

from __future__ import annotations

import contextlib
import mmap

import torch


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """uint8 ``[nbytes]`` in anonymous memory the OS may back with 2 MiB pages (Linux's transparent huge pages,
    asked for with ``madvise``; elsewhere, or where they are off, ordinary pages)."""
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # a kernel built without transparent huge pages
            region.madvise(advice)
    return torch.frombuffer(region, dtype=torch.uint8)[:nbytes]
