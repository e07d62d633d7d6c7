"""kernels/cpu_token_bitmask.py: the C kernel that applies a grammar's bitmask to CPU logits against the torch
twin (``apply_token_bitmask_torch``) over word patterns (all allowed, none, mixed), vocabularies that end
inside a word, row subsets, strided rows and thread counts; the dispatch of ``apply_token_bitmask``; and the
sampler's masked greedy pick through it."""

from __future__ import annotations

import pytest
import torch

from engine.structured_output.bitmask import (allocate_bitmask, apply_token_bitmask,
                                              apply_token_bitmask_torch, bitmask_words)
from kernels.cpu_token_bitmask import CpuTokenBitmask


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> CpuTokenBitmask:
    loaded = CpuTokenBitmask.load(tmp_path_factory.mktemp("cpu_kernels"))
    assert loaded is not None, "the bitmask kernel did not build (is gcc installed?)"
    return loaded


def _bitmask(rows: int, vocab: int, pattern: str, g: torch.Generator) -> torch.Tensor:
    bm = allocate_bitmask(rows, vocab, pin_memory=False)                                    # all allowed
    if pattern == "random":
        bm.copy_(torch.randint(-2**31, 2**31 - 1, bm.shape, generator=g, dtype=torch.int64).to(torch.int32))
    elif pattern == "few-allowed":                                                          # structural JSON
        bm.zero_()
        some = torch.randint(1, 2**31 - 1, bm[:, ::7].shape, generator=g, dtype=torch.int64)
        bm[:, ::7] = some.to(torch.int32)
    elif pattern == "mostly-allowed":                                                       # inside a string
        bm[:, ::5] = 0x0F0F0F0F
    return bm


@pytest.mark.parametrize("pattern", ["random", "few-allowed", "mostly-allowed", "all-allowed"])
@pytest.mark.parametrize("vocab", [49152, 1000, 33, 5])        # 1000, 33, 5: the last word is partial
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_equals_the_twin(kernel, pattern, vocab, threads):
    g = torch.Generator().manual_seed(vocab + len(pattern))
    logits = torch.randn(6, vocab, generator=g)
    bm = _bitmask(6, vocab, pattern, g)
    rows = [0, 2, 5]
    got, want = logits.clone(), logits.clone()
    kernel.apply(got, bm, rows, vocab, num_threads=threads)
    apply_token_bitmask_torch(want, bm, rows)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 3, 4]], logits[[1, 3, 4]])                    # rows not listed: untouched
    if pattern != "all-allowed":
        assert torch.isneginf(got[rows]).any()


def test_strided_rows_and_a_wider_bitmask(kernel):
    """Logits rows inside a wider buffer, a bitmask of more rows and words than the logits need."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(4, 130, generator=g)
    logits = wide[:, :100]                                                           # row stride 130
    bm = _bitmask(8, 160, "random", g)
    want = logits.clone()
    apply_token_bitmask_torch(want, bm[:, :bitmask_words(100)].contiguous(), [1, 3])
    kernel.apply(logits, bm, [1, 3], 100)
    assert torch.equal(logits, want) and torch.equal(wide[:, 100:], wide[:, 100:].clone())


def test_arguments_are_checked(kernel):
    logits, bm = torch.zeros(2, 64), allocate_bitmask(2, 64, pin_memory=False)
    with pytest.raises(ValueError, match="logits"):
        kernel.apply(logits.double(), bm, [0], 64)
    with pytest.raises(ValueError, match="bitmask"):
        kernel.apply(logits, bm.long(), [0], 64)
    with pytest.raises(ValueError, match="vocab_size"):
        kernel.apply(logits, bm, [0], 65)
    with pytest.raises(ValueError, match="rows"):
        kernel.apply(logits, bm, [2], 64)
    kernel.apply(logits, bm, [], 64)
    assert torch.equal(logits, torch.zeros(2, 64))


def test_apply_token_bitmask_takes_the_kernel_on_cpu_float32(kernel):
    """Logits wider than the bitmask's bits: the columns past them are masked too, as by xgrammar's path."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 70, generator=g)
    bm = _bitmask(3, 64, "random", g)
    got, want = logits.clone(), logits.clone()
    apply_token_bitmask(got, bm, torch.tensor([0, 2]), cpu_kernel=kernel)
    apply_token_bitmask_torch(want, bm, [0, 2])
    assert torch.equal(got, want) and torch.isneginf(got[[0, 2], 64:]).all()
    half = logits.to(torch.bfloat16)                                                 # not float32: xgrammar's
    apply_token_bitmask(half, bm, [1], cpu_kernel=kernel)
    assert torch.isneginf(half[1]).any()
