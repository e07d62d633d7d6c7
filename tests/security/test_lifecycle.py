"""An engine releases everything it took: ``LLM.close()``, ``with LLM(...) as llm:`` and ``del llm`` (then
``gc.collect()``) all join the tensor-parallel workers, destroy the process group (a second TP=2 engine
in the same process starts), and bring threads, file descriptors and the resident set back to their
level before; ``AsyncLLM.shutdown`` joins its transport's threads (in-process and engine process).
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import weakref

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import EngineDeadError, EngineStartupError
from tests.conftest import build_tiny_checkpoint
from tests.server.conftest import wait_until

NUM_CYCLES = 9
RSS_TOLERANCE_BYTES = 32 << 20
"""Growth of the resident set allowed over the cycles after the warm-up one (one engine of the
checkpoint below holds ~16 MB of weights: a leaked engine per cycle would add ~140 MB)."""
FD_TOLERANCE = 2
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _snapshot() -> dict[str, int]:
    return {"threads": threading.active_count(), "tasks": len(os.listdir("/proc/self/task")),
            "fds": len(os.listdir("/proc/self/fd")), "rss": _rss_bytes()}


def _assert_no_growth(before: dict[str, int], after: dict[str, int]) -> None:
    assert after["threads"] == before["threads"], (before, after, [t.name for t in threading.enumerate()])
    assert after["tasks"] == before["tasks"], (before, after)
    assert after["fds"] <= before["fds"] + FD_TOLERANCE, (before, after)
    assert after["rss"] <= before["rss"] + RSS_TOLERANCE_BYTES, (before, after)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Big enough that a leaked engine shows in the resident set (~16 MB of float32 weights)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("lifecycle"), "llama", hidden_size=256,
                                 intermediate_size=2048)


def _llm(model_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
               **kwargs)


def _generate(llm: LLM) -> list[int]:
    return llm.generate(["Hello there", "abc"], PARAMS, use_tqdm=False)[1].outputs[0].token_ids


def _cycle(model_dir, variant: str, tokens: list, kept: list) -> None:
    """One engine, made to generate, then released the ``variant`` way. A closed LLM goes into ``kept``
    (a caller may hold it after ``close``): what it held must be released all the same."""
    if variant == "with":
        with _llm(model_dir) as llm:
            tokens.append(_generate(llm))
        assert llm.llm_engine.closed and llm.llm_engine.core.runner is None
        with pytest.raises(EngineDeadError, match="closed"):
            llm.generate(["Hello"], PARAMS, use_tqdm=False)
        kept.append(llm)
        return
    llm = _llm(model_dir)
    tokens.append(_generate(llm))
    if variant == "close":
        llm.close()
        llm.close()   # idempotent
        assert llm.llm_engine.closed and llm.llm_engine.core.runner is None
        kept.append(llm)
        return
    engine = weakref.ref(llm.llm_engine)
    core = llm.llm_engine.core
    del llm
    gc.collect()
    assert engine() is None and core.runner is None, "the LLM's engine outlived it"


def test_create_close_cycles_do_not_grow_threads_fds_or_rss(model_dir):
    tokens: list = []
    kept: list = []
    variants = ["close", "with", "del"]
    _cycle(model_dir, "close", tokens, kept)               # warm-up: imports, thread pools, caches
    before = _snapshot()
    for i in range(NUM_CYCLES):
        _cycle(model_dir, variants[i % len(variants)], tokens, kept)
    _assert_no_growth(before, _snapshot())
    assert len(kept) == 1 + sum(variants[i % len(variants)] != "del" for i in range(NUM_CYCLES))
    assert all(t == tokens[0] for t in tokens)             # every engine worked


def test_two_tensor_parallel_engines_one_after_the_other(tiny_llama_dir):
    """TP=2 on gloo: the first engine's worker is joined and its process group destroyed on leaving the
    ``with``, so the second forms its own; an engine still open refuses a second one with an error that
    says what to do; ``del`` + ``gc.collect()`` releases the second."""
    import torch.distributed as dist

    kwargs = dict(device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks_override=32,
                  tensor_parallel_size=2)
    threads_before = threading.active_count()
    with LLM(str(tiny_llama_dir), **kwargs) as first:
        ref = first.generate(["Hello there"], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        workers = list(first.llm_engine.core.executor.procs)
    assert not any(p.is_alive() for p in workers) and not dist.is_initialized()
    assert threading.active_count() == threads_before, [t.name for t in threading.enumerate()]
    after_first = _snapshot()

    second = LLM(str(tiny_llama_dir), **kwargs)
    assert second.generate(["Hello there"], PARAMS, use_tqdm=False)[0].outputs[0].token_ids == ref
    with pytest.raises(EngineStartupError, match="another tensor-parallel engine is still open"):
        LLM(str(tiny_llama_dir), **kwargs)
    workers = list(second.llm_engine.core.executor.procs)
    del second
    gc.collect()
    assert not any(p.is_alive() for p in workers) and not dist.is_initialized()
    after_second = _snapshot()
    assert after_second["threads"] == after_first["threads"] == threads_before
    assert after_second["fds"] <= after_first["fds"] + FD_TOLERANCE, (after_first, after_second)


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_async_llm_shutdown_joins_its_threads(tiny_llama_dir, engine_process):
    from engine.async_llm import AsyncLLM

    names_before = {t.name for t in threading.enumerate()}
    llm = AsyncLLM.from_engine_args(log_requests=False, engine_process=engine_process,
                                    model=str(tiny_llama_dir), max_model_len=128, num_gpu_blocks_override=32)

    async def go() -> list[int]:
        stream = await llm.add_request("Hello there", PARAMS, "r")
        return [out async for out in stream][-1].outputs[0].token_ids

    try:
        assert len(asyncio.run(go())) == 4
        assert len(threading.enumerate()) > len(names_before)
    finally:
        llm.shutdown()
    transport = {"chorus-engine", "chorus-engine-client", "QueueFeederThread"}
    assert not {t.name for t in threading.enumerate() if t.is_alive()} & transport   # joined by shutdown
    # Worker pool threads stop once idle (shutdown does not wait for a running media job).
    assert wait_until(lambda: {t.name for t in threading.enumerate()} <= names_before, timeout_s=5), \
        [t.name for t in threading.enumerate()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", ["close", "with", "del"])
def test_a_released_cuda_engine_returns_its_gpu_memory(model_dir, variant):
    """On CUDA (CUDA graphs captured, KV cache sized from the free memory): what the engine allocated
    and what torch's allocator cached for it go back to the device, whichever way it is released."""
    gc.collect()
    torch.cuda.empty_cache()
    allocated_before, reserved_before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    kwargs = dict(device="cuda", dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.3)
    if variant == "with":
        with LLM(str(model_dir), **kwargs) as llm:
            assert len(_generate(llm)) == 4
            assert torch.cuda.memory_reserved() > reserved_before + (256 << 20)   # weights, KV cache, graphs
    else:
        llm = LLM(str(model_dir), **kwargs)
        assert len(_generate(llm)) == 4
        assert torch.cuda.memory_reserved() > reserved_before + (256 << 20)
        if variant == "close":
            llm.close()
        else:
            del llm
            gc.collect()
    assert torch.cuda.memory_allocated() <= allocated_before + (1 << 20)
    assert torch.cuda.memory_reserved() <= reserved_before + (64 << 20)
