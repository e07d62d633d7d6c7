"""Scheduler-side pool of adapter rank rows: which pages of the device pool each resident adapter holds.

Rank rows are the unit of adapter memory. An adapter of rank r puts, in every adapted projection, r rows
of A (``in`` values each) and r columns of B (``out`` values each) on the device; summed over the adapted
layers, one rank row costs the same bytes whatever the adapter (``row_bytes``). The device pool is
``num_pages`` pages of ``PAGE_ROWS`` rank rows: an adapter holds ``cdiv(rank, PAGE_ROWS)`` pages, anywhere
in the pool (its slot's page table lists them), so adapters of ranks 8 and 128 share one pool without
padding every slot to the largest rank, and no pool ever fragments. ``--max-lora-rank`` is the largest
rank accepted, not the size of a slot.

Ints only: the runner owns the tensors and copies an adapter into the pages the step message names.
"""

from __future__ import annotations

from typing import Optional

PAGE_ROWS = 8
"""Rank rows per page: the unit the pool hands out (rank 8 fills one page, rank 12 two)."""


def pages_for_rank(rank: int, page_rows: int = PAGE_ROWS) -> int:
    """Pages an adapter of ``rank`` holds."""
    return -(-rank // page_rows)


def pool_num_pages(pool_bytes: Optional[int], row_bytes: int, max_loras: int, max_lora_rank: int,
                   page_rows: int = PAGE_ROWS) -> int:
    """Pages of a pool of ``pool_bytes`` device bytes, one rank row costing ``row_bytes``.

    None: the pool of ``max_loras`` adapters of ``max_lora_rank`` (the default: any ``max_loras`` adapters
    the engine accepts fit at once). ValueError, saying what to set, when the pool cannot hold one adapter of
    ``max_lora_rank``.
    """
    if row_bytes < 1:
        raise ValueError(f"row_bytes={row_bytes} must be >= 1.")
    per_adapter = pages_for_rank(max_lora_rank, page_rows)
    if pool_bytes is None:
        return max_loras * per_adapter
    pages = pool_bytes // (row_bytes * page_rows)
    if pages < per_adapter:
        need = per_adapter * page_rows * row_bytes
        raise ValueError(f"max_lora_pool_bytes={pool_bytes} holds {pages} pages of {page_rows} rank rows "
                         f"({row_bytes} bytes a row on this model), less than one adapter of max_lora_rank="
                         f"{max_lora_rank} ({per_adapter} pages): raise --max-lora-pool-bytes to at least "
                         f"{need} or lower --max-lora-rank.")
    return pages


class RankPagePool:
    """Free list of the pool's pages; ``allocate`` hands out the lowest free pages first (so few adapters
    stay in the low pages).

    Args:
        num_pages: pages in the pool.
        page_rows: rank rows per page.
        row_bytes: device bytes of one rank row over every adapted layer (0: byte counts read 0).
    """

    def __init__(self, num_pages: int, page_rows: int = PAGE_ROWS, row_bytes: int = 0) -> None:
        if num_pages < 1 or page_rows < 1 or row_bytes < 0:
            raise ValueError(f"RankPagePool(num_pages={num_pages}, page_rows={page_rows}, row_bytes={row_bytes}): "
                             "pages and rows must be >= 1, bytes >= 0.")
        self.num_pages = num_pages
        self.page_rows = page_rows
        self.row_bytes = row_bytes
        self._free = [True] * num_pages
        self._num_free = num_pages

    def pages_for(self, rank: int) -> int:
        """Pages an adapter of ``rank`` holds."""
        return pages_for_rank(rank, self.page_rows)

    def fits_ever(self, rank: int) -> bool:
        """Whether an adapter of ``rank`` fits the empty pool."""
        return self.pages_for(rank) <= self.num_pages

    @property
    def num_free(self) -> int:
        """Free pages."""
        return self._num_free

    def allocate(self, rank: int) -> Optional[tuple[int, ...]]:
        """The pages of a new adapter of ``rank`` (lowest free first), or None when too few are free."""
        need = self.pages_for(rank)
        if need > self._num_free:
            return None
        pages = tuple(p for p, free in enumerate(self._free) if free)[:need]
        for p in pages:
            self._free[p] = False
        self._num_free -= need
        return pages

    def free(self, pages: tuple[int, ...]) -> None:
        """Give back an adapter's pages."""
        for p in pages:
            assert not self._free[p], f"page {p} freed twice"
            self._free[p] = True
        self._num_free += len(pages)

    # --- bytes -------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        """Device bytes of the whole pool."""
        return self.num_pages * self.page_rows * self.row_bytes

    @property
    def used_bytes(self) -> int:
        """Device bytes of the pages adapters hold."""
        return (self.num_pages - self._num_free) * self.page_rows * self.row_bytes

    def bytes_for(self, rank: int) -> int:
        """Device bytes an adapter of ``rank`` holds (its pages)."""
        return self.pages_for(rank) * self.page_rows * self.row_bytes
