"""Zeroed CPU tensors backed by transparent huge pages where the kernel allows it.

An adapter bank is one large fp32 tensor that every decode step streams through in per-slot
blocks a bank row apart; with 4 KiB pages that walk costs a TLB miss every few KiB. Asking
for huge pages (madvise MADV_HUGEPAGE, before the pages are first touched) made the native
LoRA kernels faster at decode (docs/performance.md). It is only a hint: where it is refused
(not Linux, THP off) the tensor is the same, on ordinary pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

import torch

log = logging.getLogger(__name__)

MADV_HUGEPAGE = 14  # linux/mman.h
HUGE_PAGE = 2 << 20


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def zeros(*shape: int, device: torch.device | str | None = None) -> torch.Tensor:
    """torch.zeros(shape, float32) whose whole 2 MiB-aligned span is advised MADV_HUGEPAGE."""
    tensor = torch.empty(*shape, dtype=torch.float32, device=device)
    madvise = _madvise() if tensor.device.type == "cpu" else None
    if madvise is not None:
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        aligned = -(-start // HUGE_PAGE) * HUGE_PAGE
        if end - aligned >= HUGE_PAGE:
            length = (end - aligned) // HUGE_PAGE * HUGE_PAGE
            if madvise(aligned, length, MADV_HUGEPAGE) != 0:
                log.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
    return tensor.zero_()
