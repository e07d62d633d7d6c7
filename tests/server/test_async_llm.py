"""``AsyncLLM`` over a real tiny engine core in a thread: streaming, validation errors, stop
strings found on the client, cancellation, engine death, batching, merged deltas."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM
from engine.async_llm import AsyncLLM
from engine.core_messages import GetStats
from engine.errors import EngineDeadError
from engine.outputs import CompletionOutput, RequestOutput
from engine.request_stream import OutputCollector
from engine.sampling_params import RequestOutputKind, SamplingParams
from tests.conftest import TINY_PROMPTS


def params(max_tokens: int = 5, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA, **kw)


@pytest.fixture
def llm(tiny_llama_dir):
    a = AsyncLLM.from_engine_args(log_requests=False, model=str(tiny_llama_dir), max_model_len=256)
    yield a
    a.shutdown()


def run(coro):
    return asyncio.run(coro)


async def collect(llm: AsyncLLM, prompt, p: SamplingParams, request_id: str) -> list[RequestOutput]:
    return [o async for o in llm.generate(prompt, p, request_id)]


def _idle(llm: AsyncLLM) -> bool:
    s = llm.get_stats()
    return s.num_running_reqs == 0 and s.num_waiting_reqs == 0 and s.kv_cache_usage == 0.0


async def _wait_idle(llm: AsyncLLM) -> bool:
    for _ in range(200):
        if _idle(llm):
            return True
        await asyncio.sleep(0.01)
    return False


def test_generate_streams_the_offline_text(llm, tiny_llama_dir):
    outs = run(collect(llm, TINY_PROMPTS[0], params(12), "r1"))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 12
    assert outs[-1].outputs[0].finish_reason == "length"
    offline = LLM(model=str(tiny_llama_dir), max_model_len=256).generate(
        TINY_PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert "".join(o.outputs[0].text for o in outs) == offline.outputs[0].text
    assert [t for o in outs for t in o.outputs[0].token_ids] == offline.outputs[0].token_ids
    assert llm._states == {} and not llm.output_processor.has_unfinished()


def test_value_error_reaches_caller_and_nothing_is_sent(llm):
    async def go():
        with pytest.raises(ValueError, match="prompt"):
            await llm.add_request("", params(), "bad")
        assert llm._states == {}
        return await collect(llm, "ok", params(2), "bad")   # the same id is free, the engine works

    assert sum(len(o.outputs[0].token_ids) for o in run(go())) == 2


def test_stop_string_found_on_the_client_stops_the_sequence_in_the_core(llm):
    async def go():
        full = "".join(o.outputs[0].text for o in await collect(llm, TINY_PROMPTS[3], params(40), "a"))
        stop = full[len(full) // 2:len(full) // 2 + 3]
        assert len(stop) == 3
        outs = await collect(llm, TINY_PROMPTS[3], params(40, stop=[stop]), "b")
        return full, stop, outs, await _wait_idle(llm)

    full, stop, outs, idle = run(go())
    text = "".join(o.outputs[0].text for o in outs)
    assert text == full[:full.index(stop)]
    assert outs[-1].outputs[0].finish_reason == "stop" and outs[-1].outputs[0].stop_reason == stop
    assert idle     # the core aborted the sequence and freed its blocks


def test_cancelled_consumer_aborts_request(llm):
    async def go():
        async def consume():
            async for _ in llm.generate(TINY_PROMPTS[1], params(200), "long"):
                pass

        task = asyncio.ensure_future(consume())
        while llm.get_stats().num_running_reqs == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await _wait_idle(llm)

    assert run(go())
    assert llm._states == {} and not llm.output_processor.has_unfinished()


def test_engine_fault_fails_inflight_requests_calls_and_new_requests(llm):
    async def go():
        stream = await llm.add_request("hi", params(200), "r")
        await stream.__anext__()
        llm.inject_fault()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await llm.add_request("hi", params(), "r2")
        with pytest.raises(EngineDeadError):
            await llm.call_engine(GetStats())

    run(go())
    assert llm.errored
    with pytest.raises(EngineDeadError):
        llm.check_health()


def test_concurrent_requests_share_steps_and_typed_calls(llm):
    async def go():
        results = await asyncio.gather(*[collect(llm, TINY_PROMPTS[i % 8], params(8), f"c{i}")
                                         for i in range(16)])
        assert all(sum(len(o.outputs[0].token_ids) for o in r) == 8 for r in results)
        for not_a_call in ("get_stats", "step", GetStats):   # names and classes are refused, nothing sent
            with pytest.raises(TypeError, match="not an engine call; send one of AddLoRA, RemoveLoRA"):
                await llm.call_engine(not_a_call)
        assert not llm._calls
        return await llm.call_engine(GetStats())

    stats = run(go())
    assert stats.max_reqs_per_step > 1 and llm.get_stats().max_reqs_per_step > 1


def test_n_samples_and_cumulative_outputs(llm):
    async def go():
        p = SamplingParams(n=3, max_tokens=6, temperature=0, ignore_eos=True,
                           output_kind=RequestOutputKind.CUMULATIVE)
        return await collect(llm, TINY_PROMPTS[4], p, "n3")

    outs = run(go())
    last = outs[-1]
    assert last.finished and [c.index for c in last.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in last.outputs)
    assert len({c.text for c in last.outputs}) == 1           # greedy: the same text three times


def test_shutdown_stops_the_engine_thread(llm):
    llm.shutdown()
    assert not llm._transport.is_alive()
    with pytest.raises(EngineDeadError):
        llm.check_health()


def _delta(text: str, ids: list[int], finish=None, index: int = 0) -> RequestOutput:
    return RequestOutput("r", None, [1], None, [CompletionOutput(index, text, ids, None, None, finish)],
                         finished=finish is not None)


def test_collector_merges_deltas_while_the_consumer_lags():
    async def go():
        c = OutputCollector(delta=True)
        c.put(_delta("a", [1]))
        c.put(_delta("b", [2]))
        c.put(_delta("", [3], "length"))
        first = await c.get()
        c.put_error(EngineDeadError("gone"))
        with pytest.raises(EngineDeadError):
            await c.get()
        return first

    out = run(go())
    assert out.finished and out.outputs[0].text == "ab" and out.outputs[0].token_ids == [1, 2, 3]
    assert out.outputs[0].finish_reason == "length"
