"""The sharding math of tensor parallelism per layer kind, in one process: every rank's shard is built
with a group whose collectives are left to the test, which sums (all-reduce) or concatenates
(all-gather) the ranks' outputs by hand and compares them with the unsharded layer."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from engine.config import ParallelConfig
from engine.distributed.group import TensorParallelGroup
from engine.distributed.sharding import LinearShard, attention_shard, even_part, row_shard, vocab_part
from engine.layers.parallel import RowParallelLinear, VocabParallelEmbedding, parallel_logits
from lora.peft_adapter import TargetSlice


class LocalGroup(TensorParallelGroup):
    """Rank ``rank`` of ``size`` whose collectives return the local tensor (the test combines ranks)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x


def _groups(size: int) -> list[LocalGroup]:
    return [LocalGroup(rank=r, size=size) for r in range(size)]


@pytest.mark.parametrize("heads,kv_heads,size,want", [
    (4, 2, 2, [(2, 1, 0), (2, 1, 1)]),                    # KV heads split
    (4, 1, 2, [(2, 1, 0), (2, 1, 0)]),                    # one KV head: replicated
    (8, 2, 4, [(2, 1, 0), (2, 1, 0), (2, 1, 1), (2, 1, 1)]),   # each rank keeps its query heads' KV head
    (8, 8, 2, [(4, 4, 0), (4, 4, 4)]),                    # MHA
])
def test_attention_shard(heads, kv_heads, size, want):
    got = [attention_shard(heads, kv_heads, r, size) for r in range(size)]
    assert [(s.num_heads, s.num_kv_heads, s.kv_head_start) for s in got] == want
    group = heads // kv_heads
    for r, s in enumerate(got):   # every query head of the rank reads a KV head the rank holds
        for h in range(r * s.num_heads, (r + 1) * s.num_heads):
            assert s.kv_head_start <= h // group < s.kv_head_start + s.num_kv_heads


def test_vocab_part_pads_the_last_rank():
    assert [vocab_part(387, r, 2) for r in range(2)] == [(0, 194, 194), (194, 387, 194)]
    assert [vocab_part(5, r, 4) for r in range(4)] == [(0, 2, 2), (2, 4, 2), (4, 5, 2), (5, 5, 2)]
    with pytest.raises(ValueError):
        even_part(10, 0, 4)


def test_column_parallel_concatenates_to_the_full_projection():
    torch.manual_seed(0)
    full = torch.randn(24, 16)                        # packed q | k | v: 8 + 8 + 8 rows
    x = torch.randn(5, 16)
    want = F.linear(x, full)
    sizes, size = [8, 8, 8], 2
    outs = []
    for r in range(size):
        ranges = [even_part(s, r, size) for s in sizes]
        shard = LinearShard(16, tuple(sizes), output_ranges=tuple(ranges))
        w = torch.cat([full[sum(sizes[:i]):sum(sizes[:i]) + 8][shard.weight_shard(i, "weight").start:
                                                             shard.weight_shard(i, "weight").stop]
                       for i in range(3)])
        outs.append(F.linear(x, w).split(4, dim=-1))       # the rank's q, k, v parts
    for i in range(3):   # each packed slice is the ranks' parts side by side
        torch.testing.assert_close(torch.cat([o[i] for o in outs], dim=-1), want[:, 8 * i:8 * (i + 1)])


def test_row_parallel_sums_to_the_full_projection_with_bias_once():
    torch.manual_seed(0)
    w, b = torch.randn(6, 12), torch.randn(6)
    x = torch.randn(3, 12)
    total = torch.zeros(3, 6)
    for group in _groups(3):
        shard = row_shard(12, 6, group.rank, group.size)
        layer = RowParallelLinear(4, [6], True, group, shard)
        cut = shard.weight_shard(0, "weight")
        assert cut.dim == 1 and shard.weight_shard(0, "bias") is None   # bias read whole
        layer.weight.data.copy_(w[:, cut.start:cut.stop])
        layer.bias.data.copy_(b)
        layer.keep_bias_on_first_rank()
        assert not layer.uses_decode_gemv(x, None)
        total += layer(x[:, cut.start:cut.stop])
    torch.testing.assert_close(total, F.linear(x, w, b))


def test_vocab_parallel_embedding_and_logits():
    torch.manual_seed(0)
    vocab, hidden = 11, 4
    table = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 5, 6, 10, 3])
    h = torch.randn(2, hidden)
    embeds, logits = torch.zeros(5, hidden), []
    for group in _groups(2):
        emb = VocabParallelEmbedding(vocab, hidden, group)
        part = table[emb.start:emb.stop]
        emb.weight.data[:part.shape[0]].copy_(part)
        embeds += emb(ids)
        logits.append(parallel_logits(h, emb.weight, group, vocab))   # [2, rows] (gather left to us)
    torch.testing.assert_close(embeds, table[ids])
    torch.testing.assert_close(torch.cat(logits, dim=-1)[:, :vocab], h @ table.t())


def test_slora_shards_of_an_adapter():
    """Column-parallel: B split with the output, A whole; row-parallel: A split with the input, B whole
    (the partial updates add up through the layer's all-reduce)."""
    torch.manual_seed(0)
    a, b = torch.randn(4, 12), torch.randn(10, 4)         # A [r, in], B [out, r]
    x = torch.randn(3, 12)
    want = x @ a.t() @ b.t()
    column = [TargetSlice("m", 0, 12, 10, output_range=even_part(10, r, 2)) for r in range(2)]
    outs = []
    for t in column:
        ar, br = t.shard(a, b)
        assert ar.shape == (4, 12) and br.shape == (5, 4)
        outs.append(x @ ar.t() @ br.t())
    torch.testing.assert_close(torch.cat(outs, dim=-1), want)
    row = [TargetSlice("m", 0, 12, 10, input_range=even_part(12, r, 3)) for r in range(3)]
    total = torch.zeros_like(want)
    for r, t in enumerate(row):
        ar, br = t.shard(a, b)
        assert ar.shape == (4, 4) and br.shape == (10, 4)
        total += x[:, 4 * r:4 * (r + 1)] @ ar.t() @ br.t()
    torch.testing.assert_close(total, want)


def test_each_rank_reads_only_its_shard(tiny_qwen2_dir):
    """A rank's model loads slices of the checkpoint (``get_slice``) that match the full tensors' rows and
    columns, and no tensor it receives is larger than its share (norms excepted)."""
    from transformers import AutoConfig

    from engine.loader import iter_weights, resolve_model
    from engine.loader.safetensors_loader import iter_checkpoint_tensors
    from engine.models.llama import Qwen2ForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_qwen2_dir)
    full = dict(iter_checkpoint_tensors(tiny_qwen2_dir, torch.float32, skip_lm_head=False))
    resolved = resolve_model(str(tiny_qwen2_dir), None)
    for group in _groups(2):
        model = Qwen2ForCausalLM(cfg, max_position=64, tp=group)
        received = {}

        def weights():
            for name, t in iter_weights(resolved, torch.float32, shard_of=model.checkpoint_shard):
                received[name] = t
                yield name, t
        model.load_weights(weights())
        for name, t in received.items():
            if t.dim() == 2 and "norm" not in name:
                assert t.numel() * 2 <= full[name].numel(), name
        r = group.rank
        attn = model.model.layers[0].self_attn
        hd = attn.head_dim
        kv = attn.num_kv_heads * hd
        q_rows = full["model.layers.0.self_attn.q_proj.weight"][r * attn.q_size:(r + 1) * attn.q_size]
        torch.testing.assert_close(attn.qkv_proj.weight[:attn.q_size], q_rows)
        k_bias = full["model.layers.0.self_attn.k_proj.bias"][r * kv:(r + 1) * kv]
        torch.testing.assert_close(attn.qkv_proj.bias[attn.q_size:attn.q_size + kv], k_bias)
        o_cols = full["model.layers.0.self_attn.o_proj.weight"][:, r * attn.q_size:(r + 1) * attn.q_size]
        torch.testing.assert_close(attn.o_proj.weight, o_cols)


def test_parallel_config_errors_say_how_to_fix():
    cfg = argparse.Namespace(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by --tensor-parallel-size 3.*"
                                         r"\[1, 2, 4\]"):
        ParallelConfig(tensor_parallel_size=3).check_model(cfg)
    ParallelConfig(tensor_parallel_size=4).check_model(cfg)            # KV heads replicated
    with pytest.raises(ValueError, match="needs 2 GPUs, but 1 are visible"):
        ParallelConfig(tensor_parallel_size=2).check_devices("cuda", 1)
    ParallelConfig(tensor_parallel_size=2).check_devices("cpu", 0)
    with pytest.raises(ValueError, match="integer >= 1"):
        ParallelConfig(tensor_parallel_size=0)
    whisper = argparse.Namespace(num_attention_heads=6, decoder_attention_heads=4, decoder_ffn_dim=96)
    ParallelConfig(tensor_parallel_size=4).check_model(whisper)        # the decoder's heads count, not the encoder's
    with pytest.raises(ValueError, match="decoder_ffn_dim=98 is not divisible by --tensor-parallel-size 4"):
        ParallelConfig(tensor_parallel_size=4).check_model(argparse.Namespace(num_attention_heads=4,
                                                                              decoder_ffn_dim=96 + 2))


def test_cli_flag():
    from engine.server.args import add_serve_args, engine_kwargs

    for flag in ("--tensor-parallel-size", "-tp"):
        args = add_serve_args(argparse.ArgumentParser()).parse_args(["/nonexistent", flag, "2"])
        assert args.tensor_parallel_size == 2
        assert engine_kwargs(args)["tensor_parallel_size"] == 2
