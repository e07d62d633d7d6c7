"""Which CUDA graph a step replays (``StepGraphs.key_for``) and which graphs are captured.

Pure host logic: no graph is captured here (the graph path itself runs on CPU in
tests/models/test_graph_layout.py, and on CUDA in tests/models/test_gpu_parity.py).
"""

from __future__ import annotations

from engine.cuda_graphs import GraphKey, StepGraphs, graph_batch_sizes, graph_token_sizes


class _FewAdapters:
    """A LoRA manager stand-in asking for a few-adapters variant of decode buckets up to 64."""

    def __init__(self, bound):
        self.bound = bound

    def few_adapters_bound(self, num_tokens):
        return self.bound if self.bound and num_tokens <= 64 else None


def _graphs(batch_sizes, token_sizes, max_num_reqs=256, lora=False, few=0) -> StepGraphs:
    g = StepGraphs(model=None, buffers=None, max_model_len=2048, batch_sizes=batch_sizes,
                   token_sizes=token_sizes, max_num_reqs=max_num_reqs,
                   lora_manager=_FewAdapters(few) if lora else None)
    for key in g.keys_to_capture():
        g.graphs[key] = None     # "captured"
    return g


def test_bucket_lists():
    assert graph_batch_sizes(256, 8192)[:4] == [1, 2, 4, 8] and graph_batch_sizes(256, 8192)[-1] == 256
    assert graph_batch_sizes(5, 8192) == [1, 2, 4, 5]
    sizes = graph_token_sizes(8192, 2048)
    assert sizes[0] == 64 and sizes[-1] == 2048 and len(sizes) == 24
    assert all(b - a == 64 for a, b in zip(sizes, sizes[1:]) if b <= 1024)
    assert graph_token_sizes(1000, 2048)[-1] == 1000          # the step budget is always a bucket
    assert graph_token_sizes(8192, 0) == []                    # mixed-step graphs off


def test_decode_and_mixed_keys():
    g = _graphs([1, 2, 4, 8], [64, 128, 192])
    assert g.key_for(3, 3, decode_only=True, num_adapters=0) == GraphKey(False, 4, False)
    assert g.key_for(9, 9, decode_only=True, num_adapters=0) is None          # past the largest bucket
    assert g.key_for(3, 70, decode_only=False, num_adapters=0) == GraphKey(True, 128, False)
    assert g.key_for(3, 64, decode_only=False, num_adapters=0) == GraphKey(True, 64, False)
    assert g.key_for(3, 193, decode_only=False, num_adapters=0) is None      # runs eagerly
    assert g.key_for(300, 190, decode_only=False, num_adapters=0) is None    # more requests than the graph
    assert g.batch_size_for(5) == 8


def test_lora_variants():
    g = _graphs([1, 2, 4], [64], lora=True)
    keys = set(g.keys_to_capture())
    # Every bucket has a LoRA variant and one without LoRA nodes.
    assert GraphKey(False, 2, True) in keys and GraphKey(False, 2, False) in keys
    assert GraphKey(True, 64, True) in keys and GraphKey(True, 64, False) in keys
    assert g.key_for(2, 2, decode_only=True, num_adapters=1) == GraphKey(False, 2, True)
    assert g.key_for(2, 2, decode_only=True, num_adapters=0) == GraphKey(False, 2, False)
    assert g.key_for(2, 40, decode_only=False, num_adapters=0) == GraphKey(True, 64, False)
    assert g.key_for(2, 40, decode_only=False, num_adapters=2) == GraphKey(True, 64, True)
    assert not any(k.few_adapters for k in keys)          # the kernels do not depend on the count
    # Largest first: later captures reuse the pool memory of earlier ones.
    order = g.keys_to_capture()
    assert [k.num_tokens for k in order] == sorted((k.num_tokens for k in order), reverse=True)


def test_few_adapter_variants():
    """Where the manager asks for it, decode buckets get a third LoRA variant for steps of few
    adapters, and a decode step takes it only when it runs at most that many adapters."""
    g = _graphs([1, 2, 64, 128], [64, 128], lora=True, few=4)
    keys = set(g.keys_to_capture())
    assert GraphKey(False, 64, True, 4) in keys and GraphKey(False, 1, True, 4) in keys
    assert GraphKey(False, 128, True, 4) not in keys and GraphKey(False, 128, True) in keys
    assert not any(k.mixed and k.few_adapters for k in keys)                 # decode graphs only
    assert g.key_for(50, 50, decode_only=True, num_adapters=1) == GraphKey(False, 64, True, 4)
    assert g.key_for(50, 50, decode_only=True, num_adapters=4) == GraphKey(False, 64, True, 4)
    assert g.key_for(50, 50, decode_only=True, num_adapters=5) == GraphKey(False, 64, True)
    assert g.key_for(50, 50, decode_only=True, num_adapters=2, slot_bound=4) == GraphKey(False, 64, True, 4)
    assert g.key_for(50, 50, decode_only=True, num_adapters=2, slot_bound=5) == GraphKey(False, 64, True)
    assert g.key_for(50, 50, decode_only=True, num_adapters=0) == GraphKey(False, 64, False)
    assert g.key_for(100, 100, decode_only=True, num_adapters=1) == GraphKey(False, 128, True)
    assert g.key_for(3, 40, decode_only=False, num_adapters=2) == GraphKey(True, 64, True)
    assert str(GraphKey(False, 64, True, 4)) == "decode-64-lora<=4"
