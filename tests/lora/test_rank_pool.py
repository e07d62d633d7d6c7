"""The pool of rank rows (``lora.rank_pool``) and the slot manager placing adapters in it by their own rank."""

from __future__ import annotations

import pytest

from engine.config import LoRAConfig
from lora.rank_pool import PAGE_ROWS, RankPagePool, pages_for_rank, pool_num_pages
from lora.request import LoRARequest
from lora.slot_manager import LoRASlotManager

ROW_BYTES = 1000
"""Bytes of one rank row over every adapted layer (a made-up model)."""


def lr(name: str) -> LoRARequest:
    return LoRARequest(name, abs(hash(name)) % 10_000 + 1, f"/adapters/{name}")


def test_pages_and_pool_size() -> None:
    assert [pages_for_rank(r) for r in (1, 8, 9, 16, 64, 128)] == [1, 1, 2, 2, 8, 16]
    # Unset: max_loras adapters of max_lora_rank, whatever the model.
    assert pool_num_pages(None, ROW_BYTES, max_loras=4, max_lora_rank=64) == 4 * 64 // PAGE_ROWS
    assert pool_num_pages(None, ROW_BYTES, max_loras=3, max_lora_rank=12) == 3 * 2
    # Bytes: whole pages only.
    assert pool_num_pages(10 * PAGE_ROWS * ROW_BYTES + 1, ROW_BYTES, 4, 64) == 10
    with pytest.raises(ValueError, match="max-lora-pool-bytes to at least 64000"):
        pool_num_pages(63_999, ROW_BYTES, 4, 64)
    with pytest.raises(ValueError, match="max_lora_pool_bytes"):
        LoRAConfig(max_lora_pool_bytes=0)
    assert LoRAConfig(max_lora_pool_bytes=1 << 30).max_lora_pool_bytes == 1 << 30


def test_mixed_ranks_fit_where_padded_slots_do_not() -> None:
    """Ranks 8 + 8 + 8 + 64 in a pool of 88 rows; padded to rank 64, four slots would take 256."""
    ranks = {"a": 8, "b": 8, "c": 8, "d": 64}
    pool_bytes = sum(ranks.values()) * ROW_BYTES
    pool = RankPagePool(pool_num_pages(pool_bytes, ROW_BYTES, max_loras=4, max_lora_rank=64), row_bytes=ROW_BYTES)
    padded_bytes = len(ranks) * max(ranks.values()) * ROW_BYTES
    assert pool.capacity_bytes == pool_bytes < padded_bytes
    slots = LoRASlotManager(4, pool)
    grants = {name: slots.acquire(lr(name), rank=rank) for name, rank in ranks.items()}
    assert all(g is not None and g.load_needed and g.evicted is None for g in grants.values())
    pages = [p for g in grants.values() for p in g.pages]
    assert sorted(pages) == list(range(pool.num_pages))                 # each page once, none left over
    assert [len(g.pages) for g in grants.values()] == [1, 1, 1, 8]
    assert pool.used_bytes == pool.capacity_bytes == sum(pool.bytes_for(r) for r in ranks.values())
    assert pool.num_free == 0
    # Every slot entry is taken too; nothing more fits until something is idle.
    assert not slots.can_acquire(lr("e"), rank=8)


def test_eviction_frees_enough_pages_by_recency_and_demand() -> None:
    pool = RankPagePool(11, row_bytes=ROW_BYTES)
    slots = LoRASlotManager(6, pool)             # more entries than the pool holds adapters: pages decide
    for name, rank in (("a", 8), ("b", 8), ("c", 8), ("d", 64)):
        slots.acquire(lr(name), rank=rank)
    for name in ("a", "b", "c"):                 # released in this order: a is the least recent
        slots.release(lr(name))
    # Rank 16 needs two pages: the two least recently used idle adapters go; d runs and stays.
    grant = slots.acquire(lr("e"), rank=16)
    assert grant is not None and (grant.evicted, grant.evicted_more) == ("a", ("b",))
    assert len(grant.pages) == 2 and slots.slot_of("c") is not None and slots.slot_of("d") is not None
    assert slots.num_evictions == 2 and pool.num_free == 0
    # A waited-for adapter goes after the others: c is waited for, e is idle and not.
    slots.release(lr("e"))
    grant = slots.acquire(lr("f"), demand={"c": 0}, rank=8)
    assert grant is not None and grant.evicted == "e" and grant.evicted_more == ()
    assert pool.num_free == 1                    # e's second page stays free
    # prefetch never evicts an adapter waited for: with c wanted and f running, rank 24 cannot fit.
    assert slots.prefetch(lr("g"), demand={"c": 0, "g": 1}, rank=24) is None
    assert slots.slot_of("c") is not None and pool.num_free == 1


def test_running_adapters_are_never_evicted_and_nothing_is_held_after() -> None:
    pool = RankPagePool(pages_for_rank(64) + 2, row_bytes=ROW_BYTES)
    slots = LoRASlotManager(4, pool)
    assert slots.acquire(lr("big"), rank=64) is not None
    assert slots.acquire(lr("small"), rank=16) is not None
    # Both run: a third adapter waits (None, nothing evicted), as for a full slot table.
    assert slots.acquire(lr("other"), rank=8) is None and not slots.can_acquire(lr("other"), rank=8)
    assert slots.resident_loras() == {"big": 0, "small": 1}
    # A rank larger than the pool never fits; with everything idle it still evicts nothing.
    assert not pool.fits_ever(8 * (pool.num_pages + 1))
    slots.release(lr("big"))
    slots.release(lr("small"))
    assert slots.acquire(lr("huge"), rank=8 * (pool.num_pages + 1)) is None
    assert slots.resident_loras() == {"big": 0, "small": 1} and slots.num_evictions == 0
    # Removal while running frees the pages on the last release.
    slots.acquire(lr("small"))
    assert slots.remove("small") and slots.slot_of("small") is not None
    slots.release(lr("small"))
    assert slots.slot_of("small") is None and pool.num_free == 2
    assert slots.remove("big")
    assert slots.num_resident == 0 and pool.num_free == pool.num_pages and pool.used_bytes == 0
    assert all(slots.pages_of(s) == () for s in range(4))


def test_without_a_pool_slots_behave_as_before() -> None:
    slots = LoRASlotManager(2)
    assert slots.acquire(lr("a"), rank=128).pages == ()
    slots.acquire(lr("b"))
    slots.release(lr("a"))
    grant = slots.acquire(lr("c"))
    assert (grant.lora_slot, grant.evicted, grant.evicted_more, grant.pages) == (0, "a", (), ())


def test_serve_flag_reaches_the_engine_config() -> None:
    import argparse

    from engine.arg_utils import EngineArgs
    from engine.server.args import add_serve_args, engine_kwargs

    args = add_serve_args(argparse.ArgumentParser()).parse_args(
        ["./model", "--enable-lora", "--max-lora-rank", "128", "--max-lora-pool-bytes", "2G"])
    kwargs = engine_kwargs(args)
    assert kwargs["max_lora_pool_bytes"] == 2 << 30
    lora = EngineArgs(model="./model", enable_lora=True, max_lora_rank=128,
                      max_lora_pool_bytes=kwargs["max_lora_pool_bytes"]).create_engine_config(64).lora_config
    assert (lora.max_lora_pool_bytes, lora.max_lora_rank) == (2 << 30, 128)
