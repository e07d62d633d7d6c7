"""The bitmask kernels against their torch twin: xgrammar's C++ CPU kernel, its torch-native path and
its Triton kernel (under ``TRITON_INTERPRET=1`` on the CPU; on CUDA where a GPU is present)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine.structured_output.bitmask import (allocate_bitmask, apply_token_bitmask,
                                              apply_token_bitmask_torch, bitmask_words, unpack_bitmask)

REPO = Path(__file__).resolve().parents[2]
NEG_INF = float("-inf")


def random_case(batch: int, vocab_size: int, words: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab_size, generator=g).to(dtype)  # [B, V]
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (batch + 1, words), generator=g, dtype=torch.int32)
    return logits, bitmask  # bitmask: [B + 1, words]


def reference(logits: torch.Tensor, bitmask: torch.Tensor, rows) -> torch.Tensor:
    """Bit by bit, in Python."""
    out = logits.clone()
    words = bitmask.shape[1]
    for r in (range(logits.shape[0]) if rows is None else rows):
        for i in range(logits.shape[1]):
            allowed = i < 32 * words and (int(bitmask[r, i // 32]) >> (i % 32)) & 1
            if not allowed:
                out[r, i] = NEG_INF
    return out


def test_allocate_and_unpack():
    bitmask = allocate_bitmask(4, 49153, pin_memory=False)
    assert bitmask.shape == (4, 1537) == (4, bitmask_words(49153)) and bitmask.dtype == torch.int32
    assert unpack_bitmask(bitmask, 49153).all()
    bitmask[1, 0] = 0b1010
    assert unpack_bitmask(bitmask[1:2], 40)[0, :5].tolist() == [False, True, False, True, False]
    assert not unpack_bitmask(bitmask[:1], 49153 + 40)[0, 49184:].any()  # past the words: masked


@pytest.mark.parametrize("rows", [None, [0, 2], [3]])
@pytest.mark.parametrize("vocab_size,words", [(1, 1), (31, 1), (32, 1), (33, 2), (100, 4), (100, 3)])
def test_twin_matches_the_bit_by_bit_reference(vocab_size, words, rows):
    logits, bitmask = random_case(4, vocab_size, words, torch.float32, seed=vocab_size + words)
    want = reference(logits, bitmask, rows)
    got = logits.clone()
    apply_token_bitmask_torch(got, bitmask, rows)
    assert torch.equal(got, want)


@pytest.mark.parametrize("path", ["xgrammar-cpu", "xgrammar-torch_native", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [None, [1, 3], torch.tensor([2])])
@pytest.mark.parametrize("vocab_size,words", [(33, 2), (1000, 32), (49152, 1536), (49159, 1537),
                                              (49200, 1537)])  # the last: logits padded past the mask
def test_kernels_match_the_twin(path, dtype, rows, vocab_size, words):
    logits, bitmask = random_case(4, vocab_size, words, dtype, seed=words)
    want = logits.clone()
    apply_token_bitmask_torch(want, bitmask, rows)
    got = logits.clone()
    if path == "auto":
        apply_token_bitmask(got, bitmask, rows)
    else:
        import xgrammar as xgr

        covered = min(vocab_size, 32 * words)
        indices = rows.tolist() if isinstance(rows, torch.Tensor) else rows
        rows_bitmask = bitmask[:4] if rows is None else bitmask  # xgrammar pairs the rows one to one
        xgr.apply_token_bitmask_inplace(got, rows_bitmask, vocab_size=covered, indices=indices,
                                        backend=path.split("-", 1)[1])
        if covered < vocab_size:
            got[list(range(4)) if rows is None else indices, covered:] = NEG_INF
    assert torch.equal(got, want)


def test_empty_rows_change_nothing():
    logits, bitmask = random_case(2, 64, 2, torch.float32, seed=0)
    for kernel in ("torch", "xgrammar"):
        got = logits.clone()
        apply_token_bitmask(got, bitmask, [], kernel=kernel)
        assert torch.equal(got, logits)


TRITON_SCRIPT = textwrap.dedent("""
    import torch
    from xgrammar.kernels.apply_token_bitmask_inplace_triton import apply_token_bitmask_inplace_kernel
    from engine.structured_output.bitmask import apply_token_bitmask_torch
    from tests.structured_output.test_bitmask import random_case
    cases = 0
    for vocab_size, words in [(33, 2), (1000, 32), (5000, 157), (4097, 129)]:
        for rows in (None, [1, 3]):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                logits, bitmask = random_case(4, vocab_size, words, dtype, seed=words)
                want = logits.clone()
                apply_token_bitmask_torch(want, bitmask, rows)
                got = logits.clone()
                indices = None if rows is None else torch.tensor(rows, dtype=torch.int32)
                bitmask = bitmask[:4] if rows is None else bitmask
                num_rows = 4 if rows is None else len(rows)
                apply_token_bitmask_inplace_kernel[(4,)](
                    got, bitmask, indices, num_rows, vocab_size, got.stride()[0], bitmask.stride()[0],
                    4, 4096, num_warps=4, num_stages=3)
                assert torch.equal(got, want), (vocab_size, words, rows, dtype)
                cases += 1
    print("triton-interpret cases", cases)
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, test_cuda_kernel_matches_the_twin runs "
                    "the compiled kernel (Triton 3.6's interpreter cannot run this kernel; 3.9's can)")
def test_triton_kernel_matches_the_twin_in_interpret_mode():
    """xgrammar's Triton kernel itself (its launcher reads CUDA device properties, so the jitted kernel
    is launched directly with the launcher's arguments) on CPU tensors."""
    pytest.importorskip("triton")
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    out = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "triton-interpret cases 24" in out.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [None, [1, 3]])
def test_cuda_kernel_matches_the_twin(dtype, rows):
    logits, bitmask = random_case(4, 49159, 1537, dtype, seed=1)
    want = logits.clone()
    apply_token_bitmask_torch(want, bitmask, rows)
    got = logits.cuda()
    apply_token_bitmask(got, bitmask.cuda(), rows)
    assert torch.equal(got.cpu(), want)
