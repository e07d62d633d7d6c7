"""``lora.weights_file.read_grouped``: a safetensors file read by (dtype, shape) group with scatter reads
gives every tensor as the plain reads do, in the asked dtype with its scale folded once, whatever the
file's layout."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

from lora import weights_file
from lora.peft_adapter import _scaled
from lora.weights_file import read_grouped, read_grouped_meta


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, dtype in enumerate((torch.bfloat16, torch.float16, torch.float32, torch.float64)):
        for layer in range(3):
            out[f"l{layer}.{i}.lora_A.weight"] = torch.randn(8, 24, generator=g).to(dtype)
            out[f"l{layer}.{i}.lora_B.weight"] = torch.randn(16, 8, generator=g).to(dtype)
            out[f"l{layer}.{i}.sq_A.weight"] = torch.randn(8, 8, generator=g).to(dtype)   # A, B: one shape
            out[f"l{layer}.{i}.sq_B.weight"] = torch.randn(8, 8, generator=g).to(dtype)
    out["empty"] = torch.zeros(0, 4)
    out["scalar"] = torch.tensor(3.0)
    return out


def _fold(name: str):
    """Two scales over the B tensors (a pattern's), none elsewhere."""
    if "_B" not in name:
        return None
    return 0.25 if name.startswith("l1.") else 2.0 / 3.0


def _expected(t: torch.Tensor, scale, dtype):
    if dtype is None:
        dtype = t.dtype
    return _scaled(t.clone(), scale, dtype) if scale is not None else t.to(dtype)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float32])
def test_every_tensor_as_read_plainly_in_the_dtype_with_its_scale(tmp_path, dtype):
    tensors = _tensors()
    f = tmp_path / "adapter_model.safetensors"
    save_file(tensors, str(f))
    read = read_grouped(f, dtype, fold=_fold)
    assert set(read.tensors) == set(tensors)
    assert read.folded == {n for n in tensors if _fold(n) is not None}
    for name, t in tensors.items():
        got, want = read.tensors[name], _expected(t, _fold(name), dtype)
        assert got.dtype == want.dtype and got.shape == t.shape and got.is_contiguous(), name
        assert torch.equal(got, want), name          # bit for bit: one rounding, float32 maths


def test_meta_read_has_the_shapes_and_dtype_of_the_read(tmp_path):
    tensors = _tensors()
    f = tmp_path / "adapter_model.safetensors"
    save_file(tensors, str(f))
    meta = read_grouped_meta(f, torch.bfloat16)
    assert {n: (t.shape, t.dtype, t.is_meta) for n, t in meta.items()} == {
        n: (t.shape, torch.bfloat16, True) for n, t in read_grouped(f, torch.bfloat16).tensors.items()}


def test_gaps_short_reads_and_many_calls(tmp_path, monkeypatch):
    """A file whose tensors leave gaps, read 3 buffers and 100 bytes per call, each call returning less."""
    tensors = {f"t{i}": torch.arange(i * 10, i * 10 + 7 + i, dtype=torch.float32) for i in range(9)}
    header, blob, offset = {}, b"", 0
    for name, t in tensors.items():
        data = t.numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": [t.numel()], "data_offsets": [offset, offset + len(data)]}
        blob += data + b"\xff" * 12                     # 12 bytes of gap after each tensor
        offset += len(data) + 12
    raw = json.dumps(header).encode()
    f = tmp_path / "gappy.safetensors"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + blob)
    monkeypatch.setattr(weights_file, "_IOV_MAX", 3)
    monkeypatch.setattr(weights_file, "_READ_CALL_BYTES", 100)
    real_preadv, calls = os.preadv, []

    def short_preadv(fd, buffers, off):
        calls.append(len(buffers))
        return real_preadv(fd, buffers, off) if len(calls) % 2 else real_preadv(fd, [buffers[0][:5]], off)

    monkeypatch.setattr(weights_file.os, "preadv", short_preadv)
    read = read_grouped(f)
    assert len(calls) > 9 and max(calls) <= 3
    for name, t in tensors.items():
        assert torch.equal(read.tensors[name], t), name


def _raw_file(path, header: dict, data: bytes):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_files_it_leaves_to_safetensors_or_refuses(tmp_path):
    two = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    overlap = _raw_file(tmp_path / "o.safetensors", {"a": two, "b": {**two, "data_offsets": [4, 12]}},
                        bytes(12))
    misaligned = _raw_file(tmp_path / "m.safetensors", {"a": {**two, "data_offsets": [2, 10]}}, bytes(10))
    ints = _raw_file(tmp_path / "i.safetensors", {"a": {**two, "dtype": "I32"}}, bytes(8))
    assert read_grouped(overlap) is None and read_grouped(misaligned) is None and read_grouped(ints) is None
    short = _raw_file(tmp_path / "s.safetensors", {"a": {**two, "data_offsets": [0, 8]}}, bytes(4))
    with pytest.raises(ValueError, match="do not fit"):
        read_grouped(short)
    wrong_size = _raw_file(tmp_path / "w.safetensors", {"a": {**two, "data_offsets": [0, 4]}}, bytes(8))
    with pytest.raises(ValueError, match="do not fit"):
        read_grouped(wrong_size)
