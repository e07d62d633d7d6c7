"""LoRA kernels on the pooled layout (``kernels.lora_pages``): adapters of ranks 8, 16, 64 and 128 in one
batch, each in its own scattered pages, against the torch twins.

Every pool page no slot owns, every page-table entry past a slot's pages and every h column past a
token's slot rank holds NaN (or an out-of-range page): a kernel that read a row past a slot's rank would
put NaN into its output. The shrink must leave h's columns past the slot's rank as they were.
"""

from __future__ import annotations

import pytest
import torch

from kernels.lora_expand import LoRAExpandConfig, lora_expand
from kernels.lora_expand_norm import lora_expand_add_rms_norm
from kernels.lora_expand_silu_mul import lora_expand_silu_mul
from kernels.lora_meta import NO_LORA, build_lora_kernel_meta
from kernels.lora_pages import LoRASlotPages, slot_a, slot_b
from kernels.lora_rotary_write_kv import lora_rotary_write_kv
from kernels.lora_shrink import LoRAShrinkConfig, lora_shrink
from kernels.reference import (lora_expand_add_rms_norm_ref, lora_expand_ref, lora_expand_silu_mul_ref,
                               lora_rotary_write_kv_ref, lora_shrink_ref)
from lora.rank_pool import PAGE_ROWS
from tests.kernels.pairwise import pairwise

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""CPU tensors run the kernels through the interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

RANKS = (8, 16, 64, 128)
"""One adapter of each rank, slots 0..3; slot 4 is empty (rank 0)."""
MAX_LORAS = 5
NUM_PAGES = 40
WIDTH = 128
"""h's columns: the largest rank."""

TOL = {torch.float32: 1e-4, torch.float16: 2e-3}


def make_pages(seed: int) -> LoRASlotPages:
    """Each rank's pages drawn at random from the pool; table entries past a slot's pages out of range."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_PAGES, generator=g).tolist()
    max_pages = WIDTH // PAGE_ROWS
    table = torch.full((MAX_LORAS, max_pages), 1 << 20, dtype=torch.int32)
    for slot, rank in enumerate(RANKS):
        n = rank // PAGE_ROWS
        table[slot, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    ranks = torch.tensor(list(RANKS) + [0], dtype=torch.int32)
    return LoRASlotPages(table.to(DEVICE), ranks.to(DEVICE), PAGE_ROWS)


def owned_pages(pages: LoRASlotPages) -> set[int]:
    return {int(pages.page_table[s, i]) for s, r in enumerate(RANKS) for i in range(r // PAGE_ROWS)}


def pool_a(pages: LoRASlotPages, num_slices: int, in_dim: int, dtype: torch.dtype, g: torch.Generator):
    """[num_slices, NUM_PAGES * PAGE_ROWS, in_dim]: random rows on owned pages, NaN elsewhere."""
    a = torch.full((num_slices, NUM_PAGES, PAGE_ROWS, in_dim), float("nan"))
    for p in owned_pages(pages):
        a[:, p] = torch.randn(num_slices, PAGE_ROWS, in_dim, generator=g) / in_dim ** 0.5
    return a.flatten(1, 2).to(dtype).to(DEVICE)


def pool_b(pages: LoRASlotPages, out_dim: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """[NUM_PAGES, out_dim, PAGE_ROWS]: random on owned pages, NaN elsewhere."""
    b = torch.full((NUM_PAGES, out_dim, PAGE_ROWS), float("nan"))
    for p in owned_pages(pages):
        b[p] = torch.randn(out_dim, PAGE_ROWS, generator=g) / 8
    return b.to(dtype).to(DEVICE)


def mixed_slots(num_tokens: int, seed: int) -> torch.Tensor:
    """Every adapter and the base model in one batch (slots cycling with a random start)."""
    start = int(torch.randint(0, 5, (1,), generator=torch.Generator().manual_seed(seed)))
    cycle = [0, 1, NO_LORA, 2, 3]
    return torch.tensor([cycle[(start + t) % 5] for t in range(num_tokens)], dtype=torch.int32, device=DEVICE)


def h_with_nan_tail(h: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """h [S, split_k, T, WIDTH] with NaN in every column past the token's slot rank (and base rows)."""
    h = h.clone()
    for t, slot in enumerate(slots.tolist()):
        h[:, :, t, (RANKS[slot] if slot >= 0 else 0):] = float("nan")
    return h


@pytest.mark.parametrize("dtype,num_tokens,split_k",
                         pairwise([torch.float32, torch.float16], [5, 23], [1, 2]))
def test_shrink_expand_mixed_ranks(dtype, num_tokens, split_k):
    g = torch.Generator().manual_seed(num_tokens * 10 + split_k)
    pages = make_pages(num_tokens + split_k)
    in_dim, out_dims = 40, (24, 8, 8)
    a = pool_a(pages, len(out_dims), in_dim, dtype, g)
    bs = [pool_b(pages, n, dtype, g) for n in out_dims]
    x = torch.randn(num_tokens, in_dim, generator=g).to(dtype).to(DEVICE)
    slots = mixed_slots(num_tokens, split_k)
    meta = build_lora_kernel_meta(slots, MAX_LORAS)
    tol = TOL[dtype]

    h = torch.full((len(out_dims), split_k, num_tokens, WIDTH), 7.0, device=DEVICE)
    lora_shrink(x, a, meta, h, config=LoRAShrinkConfig(16, 16, split_k), pages=pages)
    want = lora_shrink_ref(x, a, slots, split_k=split_k, pages=pages, rank=WIDTH)
    for t, slot in enumerate(slots.tolist()):
        rank = RANKS[slot] if slot >= 0 else 0
        torch.testing.assert_close(h[:, :, t, :rank], want[:, :, t, :rank], atol=tol, rtol=tol)
        assert torch.all(h[:, :, t, rank:] == 7.0), "the shrink wrote past the slot's rank"

    y = torch.randn(num_tokens, sum(out_dims), generator=g).to(dtype).to(DEVICE)
    offsets = [0, 24, 32]
    buf = h_with_nan_tail(h, slots)
    want_y = lora_expand_ref(buf, bs, slots, y, offsets, pages=pages)
    for per_token in (0, 1):
        got = y.clone()
        lora_expand(buf, bs, meta, got, offsets, config=LoRAExpandConfig(16, 16, 2, per_token=per_token),
                    pages=pages)
        assert not got.isnan().any(), "the expand read past a slot's rank"
        torch.testing.assert_close(got, want_y, atol=tol, rtol=tol)
    # Each adapter's update is x @ A_l.T @ B_l.T with its own rank: the pool is the padded layout's content.
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            assert torch.equal(want_y[t], y[t])
            continue
        h_t = slot_a(a, pages, slot).float() @ x[t].float()                          # [S, rank]
        delta = torch.cat([slot_b(b, pages, slot).float() @ h_t[s] for s, b in enumerate(bs)])
        torch.testing.assert_close(want_y[t].float(), y[t].float() + delta, atol=10 * tol, rtol=10 * tol)


def test_pool_equals_padded_layout():
    """The same adapters padded to rank 128 in slots give the pooled launch's output."""
    g = torch.Generator().manual_seed(3)
    pages = make_pages(3)
    in_dim, out_dim, num_tokens = 24, 16, 10
    a, b = pool_a(pages, 1, in_dim, torch.float32, g), pool_b(pages, out_dim, torch.float32, g)
    a_pad = torch.zeros(1, MAX_LORAS, WIDTH, in_dim, device=DEVICE)
    b_pad = torch.zeros(MAX_LORAS, out_dim, WIDTH, device=DEVICE)
    for slot, rank in enumerate(RANKS):
        a_pad[:, slot, :rank] = slot_a(a, pages, slot)
        b_pad[slot, :, :rank] = slot_b(b, pages, slot)
    x = torch.randn(num_tokens, in_dim, generator=g).to(DEVICE)
    slots = mixed_slots(num_tokens, 1)
    meta = build_lora_kernel_meta(slots, MAX_LORAS)
    h_pool = torch.zeros(1, 1, num_tokens, WIDTH, device=DEVICE)
    h_pad = torch.zeros_like(h_pool)
    lora_shrink(x, a, meta, h_pool, pages=pages)
    lora_shrink(x, a_pad, meta, h_pad)
    torch.testing.assert_close(h_pool, h_pad, atol=1e-5, rtol=1e-5)
    y = torch.randn(num_tokens, out_dim, generator=g).to(DEVICE)
    y_pool, y_pad = y.clone(), y.clone()
    lora_expand(h_pool, [b], meta, y_pool, [0], pages=pages)
    lora_expand(h_pad, [b_pad], meta, y_pad, [0])
    torch.testing.assert_close(y_pool, y_pad, atol=1e-5, rtol=1e-5)
    assert not torch.equal(y_pool, y)


@pytest.mark.parametrize("per_token", [0, 1])
def test_silu_mul_mixed_ranks(per_token):
    g = torch.Generator().manual_seed(11 + per_token)
    pages = make_pages(11)
    d, num_tokens = 24, 9
    bs = [pool_b(pages, d, torch.float32, g) for _ in range(2)]
    slots = mixed_slots(num_tokens, 2)
    meta = build_lora_kernel_meta(slots, MAX_LORAS)
    buf = h_with_nan_tail(torch.randn(2, 2, num_tokens, WIDTH, generator=g).to(DEVICE), slots)
    y = torch.randn(num_tokens, 2 * d, generator=g).to(DEVICE)
    got = lora_expand_silu_mul(buf, bs, meta, y, config=LoRAExpandConfig(16, 16, 2, per_token=per_token),
                               pages=pages)
    assert not got.isnan().any()
    torch.testing.assert_close(got, lora_expand_silu_mul_ref(buf, bs, slots, y, pages=pages), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tiles", [False, True])
def test_add_rms_norm_mixed_ranks(tiles):
    g = torch.Generator().manual_seed(21)
    pages = make_pages(21)
    hidden, num_tokens = 48, 9
    b = pool_b(pages, hidden, torch.float32, g)
    slots = mixed_slots(num_tokens, 3)
    meta = build_lora_kernel_meta(slots, MAX_LORAS)
    buf = h_with_nan_tail(torch.randn(1, 1, num_tokens, WIDTH, generator=g).to(DEVICE), slots)
    x = torch.randn(num_tokens, hidden, generator=g).to(DEVICE)
    residual = torch.randn(num_tokens, hidden, generator=g).to(DEVICE)
    weight = torch.randn(hidden, generator=g).to(DEVICE)
    want_out, want_sum = lora_expand_add_rms_norm_ref(buf, b, slots, x, weight, 1e-6, residual, pages=pages)
    res = residual.clone()
    out = lora_expand_add_rms_norm(buf, b, meta, x.clone(), weight, 1e-6, residual=res, tiles=tiles, pages=pages)
    assert not out.isnan().any()
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(res, want_sum, atol=1e-4, rtol=1e-4)


def test_rotary_write_kv_mixed_ranks():
    g = torch.Generator().manual_seed(31)
    pages = make_pages(31)
    num_tokens, heads, kv_heads, head_dim, block_size = 6, 2, 1, 16, 4
    bs = [pool_b(pages, n * head_dim, torch.float32, g) for n in (heads, kv_heads, kv_heads)]
    slots = mixed_slots(num_tokens, 4)
    buf = h_with_nan_tail(torch.randn(3, 1, num_tokens, WIDTH, generator=g).to(DEVICE), slots)
    q = torch.randn(num_tokens, heads, head_dim, generator=g).to(DEVICE)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(DEVICE)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(DEVICE)
    positions = torch.arange(num_tokens, device=DEVICE)
    angles = torch.arange(32, dtype=torch.float32)[:, None] * torch.linspace(0.1, 1.0, head_dim // 2)[None]
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    k_cache = torch.zeros(4, block_size, kv_heads, head_dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slot_mapping = torch.arange(num_tokens, device=DEVICE)
    want = lora_rotary_write_kv_ref(positions, q, k, v, cos, sin, head_dim, k_cache, v_cache, slot_mapping,
                                    buf, bs, slots, pages=pages)
    got = [q.clone(), k.clone(), v.clone(), k_cache.clone(), v_cache.clone()]
    lora_rotary_write_kv(positions, got[0], got[1], got[2], cos, sin, head_dim, got[3], got[4], slot_mapping,
                         buf, bs, slots, pages=pages)
    for name, x, w in zip(("q", "k", "v", "k_cache", "v_cache"), got, want):
        assert not x.isnan().any(), name
        torch.testing.assert_close(x, w, atol=1e-4, rtol=1e-4, msg=name)


# ----------------------------------------------------------------------------------------
# Compiled for Hopper on any machine (the interpreter does not type-check what the compiler does)
# ----------------------------------------------------------------------------------------
_COMPILE_SCRIPT = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile
from kernels import lora_expand, lora_expand_norm, lora_expand_silu_mul, lora_rotary_write_kv, lora_shrink

INT_PTRS = ("sorted_token_ids_ptr", "active_slots_ptr", "num_tokens_per_slot_ptr", "slot_start_ptr",
            "page_table_ptr", "slot_ranks_ptr", "token_lora_slots_ptr", "slot_mapping_ptr", "positions_ptr")
FLOATS = ("scale", "eps", "k_scale", "v_scale")
COMMON = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, BLOCK_R=32, SPLIT_K=2, MAX_LORAS_PAD=8, PAGE_ROWS=8,
              UPCAST=False, DOT_PRECISION="tf32", ADD_INPUTS=True, HAS_RESIDUAL=True, CHUNK=256,
              NUM_Q_HEADS=4, NUM_KV_HEADS=2, HEAD_DIM=64, HALF=32, BLOCK_SIZE=16, HALF_PAD=32, TAIL_PAD=0,
              DIM_PAD=64)
kernels = [lora_shrink._lora_shrink_kernel, lora_expand._lora_expand_kernel, lora_expand._lora_expand_token_kernel,
           lora_expand_silu_mul._lora_expand_silu_mul_kernel, lora_expand_silu_mul._lora_expand_silu_mul_token_kernel,
           lora_expand_norm._lora_expand_add_rms_norm_kernel, lora_expand_norm._lora_expand_add_rms_norm_tile_kernel,
           lora_rotary_write_kv._lora_rotary_write_kv_kernel]
for fn, identity in [(fn, identity) for fn in kernels for identity in (False, True)]:
    signature, consts = {}, {}
    for p in fn.params:
        name = p.name
        if p.is_constexpr:
            consts[name] = (identity if name == "IDENTITY_PAGES" else "bf16" if name == "ROUND_TO" else COMMON[name])
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = ("*i32" if name in INT_PTRS else "*fp32" if name in ("buf_ptr", "cos_ptr", "sin_ptr")
                               else "*bf16")
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    if "ROUND_TO" in consts:
        import triton.language as tl
        consts["ROUND_TO"] = tl.bfloat16
    source = ASTSource(fn=fn, signature=signature, constexprs=consts)
    compiled = triton_compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
    assert compiled.asm["cubin"], fn
    print("compiled", fn.__name__, identity)
"""


def test_kernels_compile_for_sm90(tmp_path):
    """Every paged LoRA kernel, on pool pages and on the padded layout's identity pages, compiles to an sm_90
    (H100/H200) cubin through Triton's bundled ptxas with no GPU, in a process without TRITON_INTERPRET (the
    interpreter does not type-check what the compiler does)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], cwd=root, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 16
