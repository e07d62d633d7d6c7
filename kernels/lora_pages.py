"""Where each adapter slot's rank rows sit in a layer's LoRA buffers: the slots' page table.

A pooled layer holds every resident adapter in pages of ``page_rows`` rank rows
(``lora.rank_pool``):

- A: [num_slices, num_pages * page_rows, in_dim], rank row i of slot l at row
  ``page_table[l, i // page_rows] * page_rows + i % page_rows``;
- B of slice s: [num_pages, out_s, page_rows], rank column i of slot l in page
  ``page_table[l, i // page_rows]``, column ``i % page_rows`` (a page's B is one contiguous block).

Each slot has its own rank (``slot_ranks``): the shrink writes, and the expand reads, only that many
columns of h, and no kernel reads a row past a slot's rank. The padded layout (every slot
``max_rank`` rows: A [num_slices, max_loras, max_rank, in_dim], B [max_loras, out_s, max_rank]) is
the special case of one page of ``max_rank`` rows per slot, page l for slot l (``padded_pages``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels.utils import check_int, check_tensor


@dataclass
class LoRASlotPages:
    """The page table of a layer's slots (shared by every layer of one pool)."""

    page_table: torch.Tensor
    """[max_loras, max_pages] int32: pool page of each slot's i-th page of rank rows (unused: any value)."""
    slot_ranks: torch.Tensor
    """[max_loras] int32: rank of each slot's adapter (0: an empty slot, which adds nothing)."""
    page_rows: int
    """Host int: rank rows per page."""
    identity: bool = False
    """Host flag: the padded layout (``padded_pages``): page l is slot l and every slot has ``page_rows``
    rows, so the kernels read neither table (a constexpr of theirs)."""

    @property
    def max_loras(self) -> int:
        return self.page_table.shape[0]

    @property
    def max_pages(self) -> int:
        return self.page_table.shape[1]

    def check(self, max_loras: int, device: torch.device) -> None:
        """ValueError unless these describe max_loras slots on device."""
        check_tensor("pages.page_table", self.page_table, ndim=2, dtypes=(torch.int32,), shape=(max_loras, None),
                     device=device, contiguous=True)
        check_tensor("pages.slot_ranks", self.slot_ranks, ndim=1, dtypes=(torch.int32,), shape=(max_loras,),
                     device=device, contiguous=True)
        check_int("pages.page_rows", self.page_rows, min_value=1)


@functools.lru_cache(maxsize=64)
def padded_pages(max_loras: int, rank: int, device: torch.device) -> LoRASlotPages:
    """The padded layout's pages: slot l is page l, of ``rank`` rows, all of them used (one table per
    shape and device, made once: read-only)."""
    table = torch.arange(max_loras, dtype=torch.int32, device=device).view(max_loras, 1)   # [max_loras, 1]
    ranks = torch.full((max_loras,), rank, dtype=torch.int32, device=device)              # [max_loras]
    return LoRASlotPages(table, ranks, rank, identity=True)


def slot_rows(pages: LoRASlotPages, slot: int) -> torch.Tensor:
    """[rank_l] int64 pool rows of slot ``slot``'s rank rows (host read: twins and tests only)."""
    rank = int(pages.slot_ranks[slot])
    i = torch.arange(rank, device=pages.page_table.device)
    return pages.page_table[slot, i // pages.page_rows].long() * pages.page_rows + i % pages.page_rows


def slot_a(lora_a: torch.Tensor, pages: LoRASlotPages, slot: int) -> torch.Tensor:
    """[num_slices, rank_l, in_dim]: slot ``slot``'s A from the pool lora_a [num_slices, rows, in_dim]."""
    return lora_a[:, slot_rows(pages, slot)]


def slot_b(lora_b: torch.Tensor, pages: LoRASlotPages, slot: int) -> torch.Tensor:
    """[out_dim, rank_l]: slot ``slot``'s B from one slice's pool lora_b [num_pages, out_dim, page_rows]."""
    rows = slot_rows(pages, slot)
    return lora_b[rows // pages.page_rows, :, rows % pages.page_rows].t()
