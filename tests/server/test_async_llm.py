"""``AsyncLLM`` over a fake engine: streaming, validation errors, cancellation, engine death, batching."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.async_llm import AsyncLLM, EngineDeadError
from engine.outputs import CompletionOutput, RequestOutput, SchedulerStats
from engine.sampling_params import RequestOutputKind, SamplingParams


class FakeEngine:
    """One token per running request per step; records what the async layer asked for."""

    tokenizer = None
    model_name = "fake"
    max_model_len = 128

    def __init__(self, step_s: float = 0.002) -> None:
        self.step_s = step_s
        self.remaining: dict[str, int] = {}
        self.aborted: list[str] = []
        self.batch_sizes: list[int] = []
        self.thread_ids: set[int] = set()

    def add_request(self, request_id, prompt, params, lora_request=None, priority=0, arrival_time=None):
        self.thread_ids.add(threading.get_ident())
        if not prompt:
            raise ValueError("prompt: the prompt cannot be empty.")
        self.remaining[request_id] = params.max_tokens

    def abort_request(self, request_ids):
        self.thread_ids.add(threading.get_ident())
        for rid in request_ids:
            if self.remaining.pop(rid, None) is not None:
                self.aborted.append(rid)
        return []

    def has_unfinished_requests(self):
        return bool(self.remaining)

    def step(self):
        self.thread_ids.add(threading.get_ident())
        time.sleep(self.step_s)
        self.batch_sizes.append(len(self.remaining))
        outs = []
        for rid in list(self.remaining):
            self.remaining[rid] -= 1
            done = self.remaining[rid] == 0
            if done:
                del self.remaining[rid]
            outs.append(RequestOutput(
                request_id=rid, prompt="p", prompt_token_ids=[1, 2], prompt_logprobs=None, finished=done,
                outputs=[CompletionOutput(index=0, text="x", token_ids=[7], cumulative_logprob=None,
                                          logprobs=None, finish_reason="length" if done else None)]))
        return outs

    def get_stats(self):
        return SchedulerStats(num_running_reqs=len(self.remaining),
                              max_reqs_per_step=max(self.batch_sizes, default=0))


def params(max_tokens: int = 5) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA)


@pytest.fixture
def llm():
    engine = FakeEngine()
    a = AsyncLLM(engine, log_requests=False)
    yield a
    a.shutdown()


def run(coro):
    return asyncio.run(coro)


def test_generate_streams_until_finished(llm):
    async def go():
        return [o async for o in llm.generate("hi", params(5), "r1")]

    outs = run(go())
    assert len(outs) == 5 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert llm.engine.thread_ids == {llm._thread.ident}  # only the engine thread touches the engine
    assert llm._states == {}


def test_value_error_reaches_caller_and_nothing_is_aborted(llm):
    async def go():
        with pytest.raises(ValueError, match="prompt"):
            await llm.add_request("", params(), "bad")
        # The same id is free again, and the engine still works.
        return [o async for o in llm.generate("ok", params(2), "bad")]

    assert len(run(go())) == 2
    assert llm.engine.aborted == []


def test_cancelled_consumer_aborts_request(llm):
    async def go():
        async def consume():
            async for _ in llm.generate("hi", params(10_000), "long"):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if "long" in llm.engine.aborted:
                break
            await asyncio.sleep(0.01)

    run(go())
    assert llm.engine.aborted == ["long"]
    assert llm._states == {}


def test_engine_fault_fails_inflight_and_new_requests(llm):
    async def go():
        stream = await llm.add_request("hi", params(10_000), "r")
        await stream.__anext__()
        llm.inject_fault()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await llm.add_request("hi", params(), "r2")
        with pytest.raises(EngineDeadError):
            await llm.run_in_engine(lambda e: 1)

    run(go())
    assert llm.errored
    with pytest.raises(EngineDeadError):
        llm.check_health()


def test_concurrent_requests_share_steps_and_run_in_engine(llm):
    async def go():
        async def one(i):
            return [o async for o in llm.generate("hi", params(8), f"c{i}")]

        results = await asyncio.gather(*[one(i) for i in range(16)])
        assert all(len(r) == 8 for r in results)
        return await llm.run_in_engine(lambda engine: max(engine.batch_sizes))

    assert run(go()) > 1
    assert llm.get_stats().max_reqs_per_step > 1


def test_shutdown_stops_thread(llm):
    llm.shutdown()
    assert not llm._thread.is_alive()
    with pytest.raises(EngineDeadError):
        llm.check_health()
