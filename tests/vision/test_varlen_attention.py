"""encoders/varlen_attention.py: packed variable-length attention against its twin, the flash varlen call's
arguments and fallback, and the Qwen2-VL / Qwen2.5-VL towers on packed images of mixed sizes equal to the
same images one at a time (float32 on CPU; bf16 on CUDA in the gpu test)."""

from __future__ import annotations

import pytest
import torch

from encoders import varlen_attention
from encoders.qwen2_vl import frame_runs
from encoders.varlen_attention import (
    flash_varlen_supported, join_runs, packed_attention, packed_attention_reference, packed_segments,
    per_run_attention,
)
from tests.models.test_vision_encoders import _loaded_qwen, _patches

SEGMENTS = [
    [(1, 24)],                              # one image
    [(2, 16), (1, 24), (3, 4)],             # equal images batched, then other sizes
    [(1, 5), (1, 37), (2, 5), (1, 1)],      # odd lengths, a single-token segment
]
MIXED_GRIDS = [[1, 4, 6], [1, 8, 4], [1, 4, 4], [1, 4, 4], [2, 4, 6], [1, 2, 2], [1, 10, 14]]


def _qkv(num_tokens: int, heads: int = 3, head_dim: int = 8, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(num_tokens)
    return [torch.randn(num_tokens, heads, head_dim, generator=gen).to(device, dtype) for _ in range(3)]


@pytest.mark.parametrize("groups", SEGMENTS)
def test_packed_attention_on_cpu_equals_its_twin(groups):
    segments = packed_segments(join_runs(groups), torch.device("cpu"))
    q, k, v = _qkv(int(segments.cu_seqlens[-1]))
    got = packed_attention(q, k, v, segments, scale=0.3)
    want = packed_attention_reference(q, k, v, segments.cu_seqlens, scale=0.3)
    assert got.shape == q.shape
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


def test_packed_attention_of_mixed_segments_equals_each_segment_alone_exactly():
    groups = [(1, 24), (2, 16), (1, 37), (3, 4)]
    segments = packed_segments(join_runs(groups), torch.device("cpu"))
    q, k, v = _qkv(int(segments.cu_seqlens[-1]))
    together = packed_attention(q, k, v, segments, scale=0.3)
    bounds = segments.cu_seqlens.tolist()
    for start, stop in zip(bounds[:-1], bounds[1:]):
        alone = packed_segments(join_runs([(1, stop - start)]), torch.device("cpu"))
        assert torch.equal(together[start:stop],
                           packed_attention(q[start:stop], k[start:stop], v[start:stop], alone, scale=0.3))


def test_packed_segments_boundaries():
    segments = packed_segments(join_runs([(2, 16), (1, 24), (0, 9), (3, 4)]), torch.device("cpu"))
    assert segments.cu_seqlens.dtype == torch.int32
    assert segments.cu_seqlens.tolist() == [0, 16, 32, 56, 60, 64, 68]
    assert segments.max_seqlen == 24
    assert [run.num_segments for run in segments.runs] == [2, 1, 3]


def test_packed_attention_refuses_tokens_that_are_not_the_segments():
    segments = packed_segments(join_runs([(2, 4)]), torch.device("cpu"))
    q, k, v = _qkv(9)
    with pytest.raises(ValueError, match="num_tokens=8"):
        packed_attention(q, k, v, segments, scale=1.0)


@pytest.mark.parametrize("takes_scale", [True, False], ids=["scale_kwarg", "no_scale_kwarg"])
@pytest.mark.parametrize("scale", [8 ** -0.5, 0.2])
def test_flash_varlen_call_arguments(monkeypatch, takes_scale, scale):
    """The flash path hands varlen_attn the packed tensors, int32 boundaries and the longest segment, and
    reaches the same result with PyTorch builds whose varlen_attn takes no scale (q pre-scaled)."""
    calls = []

    def fake_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        calls.append((cu_q, cu_k, max_q, max_k, kwargs))
        return packed_attention_reference(q, k, v, cu_q, kwargs.get("scale", q.shape[-1] ** -0.5))

    monkeypatch.setattr(varlen_attention, "_VARLEN_ATTN", fake_varlen_attn)
    monkeypatch.setattr(varlen_attention, "_VARLEN_TAKES_SCALE", takes_scale)
    monkeypatch.setattr(varlen_attention, "flash_varlen_supported", lambda device, dtype, head_dim: True)
    segments = packed_segments(join_runs([(1, 5), (2, 7), (1, 3)]), torch.device("cpu"))
    q, k, v = _qkv(22)
    got = packed_attention(q, k, v, segments, scale=scale)
    torch.testing.assert_close(got, packed_attention_reference(q, k, v, segments.cu_seqlens, scale),
                               atol=2e-6, rtol=2e-6)
    (cu_q, cu_k, max_q, max_k, kwargs), = calls
    assert cu_q is cu_k and cu_q.dtype == torch.int32 and cu_q.tolist() == [0, 5, 12, 19, 22]
    assert (max_q, max_k) == (7, 7)
    assert kwargs == ({"scale": scale} if takes_scale else {})


def test_flash_varlen_failure_falls_back_once(monkeypatch):
    calls = []

    def failing_varlen_attn(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no flash varlen in this build")

    failed: set = set()
    monkeypatch.setattr(varlen_attention, "_VARLEN_ATTN", failing_varlen_attn)
    monkeypatch.setattr(varlen_attention, "_FAILED_SHAPES", failed)
    monkeypatch.setattr(varlen_attention, "flash_varlen_supported",
                        lambda device, dtype, head_dim: (dtype, head_dim) not in failed)
    segments = packed_segments(join_runs([(2, 6), (1, 4)]), torch.device("cpu"))
    q, k, v = _qkv(16)
    for _ in range(2):
        got = packed_attention(q, k, v, segments, scale=0.5)
        assert torch.equal(got, per_run_attention(q, k, v, segments.runs, 0.5))
    assert len(calls) == 1 and failed == {(torch.float32, 8)}


@pytest.mark.skipif(varlen_attention._VARLEN_ATTN is None, reason="this PyTorch has no varlen_attn")
def test_flash_varlen_supported_by_device_dtype_and_head_dim():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert flash_varlen_supported(cuda, torch.bfloat16, 80)        # Qwen2-VL's head_dim
    assert flash_varlen_supported(cuda, torch.float16, 64)
    assert not flash_varlen_supported(cpu, torch.bfloat16, 80)
    assert not flash_varlen_supported(cuda, torch.float32, 80)
    assert not flash_varlen_supported(cuda, torch.bfloat16, 12)    # not a multiple of 8
    assert not flash_varlen_supported(cuda, torch.bfloat16, 512)


def _together_and_alone(tower, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The tower's embeddings of MIXED_GRIDS's images in one call, and the same images one call each."""
    grid_thw = torch.tensor(MIXED_GRIDS)
    pixels = _patches(grid_thw).to(device)
    with torch.no_grad():
        together = tower(pixels, grid_thw)
        alone, first = [], 0
        for grid in MIXED_GRIDS:
            num_patches = grid[0] * grid[1] * grid[2]
            alone.append(tower(pixels[first:first + num_patches], torch.tensor([grid])))
            first += num_patches
    return together, torch.cat(alone)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_tower_on_packed_mixed_sizes_equals_one_image_at_a_time(kind):
    """Seven images of five sizes (a 2-frame video among them) in one call: every image's embeddings are
    those of the image alone in float32 on CPU (to float32 rounding: the projections' GEMMs block their
    rows differently for other row counts; the attention itself is exact, test above)."""
    assert len(frame_runs(MIXED_GRIDS)) == 6   # six SDPA calls on CPU
    together, alone = _together_and_alone(_loaded_qwen(kind)[1])
    torch.testing.assert_close(together, alone, atol=2e-5, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_varlen_on_cuda_equals_twin_and_one_image_at_a_time():
    """The CUDA path (bf16, head_dims 8 and 80) against the float32 twin within bf16 rounding; the towers
    in float32 on CUDA against the CPU, and in bf16 on packed mixed sizes against the images one at a time."""
    device = torch.device("cuda")
    for head_dim in (8, 80):
        segments = packed_segments(join_runs([(1, 5), (2, 37), (1, 256), (3, 64)]), device)
        q, k, v = _qkv(int(segments.cu_seqlens[-1]), heads=4, head_dim=head_dim, dtype=torch.bfloat16,
                       device=device)
        assert flash_varlen_supported(device, torch.bfloat16, head_dim)
        got = packed_attention(q, k, v, segments, scale=head_dim ** -0.5)
        assert flash_varlen_supported(device, torch.bfloat16, head_dim), "the flash varlen call failed"
        want = packed_attention_reference(q, k, v, segments.cu_seqlens, head_dim ** -0.5)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.backends.cuda.matmul.allow_tf32 = False
    grid_thw = torch.tensor(MIXED_GRIDS)
    pixels = _patches(grid_thw)
    for kind in ("qwen2_vl", "qwen2_5_vl"):
        _, tower = _loaded_qwen(kind)
        with torch.no_grad():   # float32: the fused rotary kernel and per-run SDPA on CUDA against the CPU
            on_cpu = tower(pixels, grid_thw)
            on_cuda = tower.to(device)(pixels.to(device), grid_thw)
        torch.testing.assert_close(on_cuda.cpu(), on_cpu, atol=1e-3, rtol=1e-3)
        together, alone = _together_and_alone(tower.to(device, torch.bfloat16), "cuda")
        torch.testing.assert_close(together.float(), alone.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_fused_rotary_kernel_path_equals_the_torch_ops(kind):
    """The CUDA rotary path (``kernels.layer_ops.rotary_embedding_`` in place on the packed q/k/v; without a
    GPU under the Triton interpreter on CPU) gives the attention of the torch ops, float32."""
    import copy

    from encoders.qwen2_vl import VisionBatch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _, tower = _loaded_qwen(kind)
    attention = copy.deepcopy(tower.blocks[0].attn).to(device)
    num_patches = 40
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(num_patches, attention.num_heads * attention.head_dim, generator=gen).to(device)
    cos, sin = (t.to(device) for t in tower.rotary(torch.randint(0, 8, (num_patches, 2), generator=gen)))
    segments = packed_segments(join_runs([(1, 24), (1, 16)]), device)
    torch_ops = VisionBatch(cos=cos, sin=sin, segments=segments)
    kernel = VisionBatch(cos=cos, sin=sin, segments=segments, patch_index=torch.arange(num_patches, device=device))
    with torch.no_grad():
        torch.testing.assert_close(attention(hidden, kernel), attention(hidden, torch_ops),
                                   atol=1e-5, rtol=1e-5)
