"""Request ids: a client-chosen id never equals an engine sequence id of another request (an ``n > 1``
request's sequences are ``{request_id}#{i}``, and ``#`` is outside the characters a client id may have),
ids are checked before any state is written, and a refused request never disturbs another's stream."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from engine.sampling_params import RequestOutputKind, SamplingParams
from tests.server.conftest import start_server, wait_until
from tests.server.test_concurrency import _idle_and_free
from tests.server.test_errors import assert_error
from tests.server.test_front_door import long_llama_dir  # noqa: F401 - the 8k-context model

MODEL = "tiny-long"


@pytest.fixture(scope="module")
def server(long_llama_dir):  # noqa: F811
    srv = start_server(str(long_llama_dir), served_model_name=[MODEL])
    yield srv
    srv.stop()


class _Victim:
    """A streamed n=2 completion with a chosen id, read in a thread to its end."""

    def __init__(self, server, request_id: str, max_tokens: int = 600) -> None:
        self.finish: dict[int, str] = {}
        self.num_chunks = 0
        self.error: list[str] = []
        body = {"model": MODEL, "prompt": "A", "n": 2, "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "request_id": request_id}
        self.thread = threading.Thread(target=self._read, args=(server, body), daemon=True)
        self.thread.start()

    def _read(self, server, body: dict) -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.error.append(line)
                    continue
                self.num_chunks += 1
                for choice in event["choices"]:
                    if choice.get("finish_reason"):
                        self.finish[choice["index"]] = choice["finish_reason"]

    def finished_normally(self) -> bool:
        self.thread.join(60)
        return not self.thread.is_alive() and not self.error and self.finish == {0: "length", 1: "length"}


def _post(server, request_id: str | None = None, headers: dict | None = None) -> httpx.Response:
    body = {"model": MODEL, "prompt": "B", "max_tokens": 2}
    if request_id is not None:
        body["request_id"] = request_id
    return httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=30)


def test_an_id_colliding_with_a_sequence_of_another_request_cannot_hang_it(server):
    victim = _Victim(server, "victim")
    assert wait_until(lambda: "victim" in server.engine_client._states and victim.num_chunks > 0, timeout_s=20)
    for forged in ("victim#0", "victim#1"):            # the victim's sequence ids: not a client id
        assert_error(_post(server, forged), 400, "request_id")
        assert_error(_post(server, headers={"X-Request-Id": forged}), 400)
    err = assert_error(_post(server, "victim"), 400)  # the victim's own id, while it runs
    assert "already in use" in err["message"], err
    assert_error(_post(server, headers={"X-Request-Id": "victim"}), 400)
    for unrelated in ("0_victim", "1_victim", "victim-0"):   # old-style child ids: just other ids now
        assert _post(server, unrelated).status_code == 200
    assert victim.finished_normally(), (victim.finish, victim.error)
    assert wait_until(lambda: server.engine_client.num_tracked_requests == 0 and _idle_and_free(server))


def _run(server, coro):
    return asyncio.run_coroutine_threadsafe(coro, server.engine_client._loop).result(60)


async def _collect(stream) -> dict[int, str]:
    finish: dict[int, str] = {}
    async for out in stream:
        for c in out.outputs:
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return finish


def test_the_engine_client_refuses_sequence_ids_before_writing_state(server):
    client = server.engine_client

    async def scenario():
        params = SamplingParams(n=2, max_tokens=50, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        victim = await client.add_request("A", params, "v")
        refused = []
        for forged in ("v#0", "v#1", "v"):
            try:
                await client.add_request("B", SamplingParams(max_tokens=2), forged)
            except ValueError as e:
                refused.append(str(e))
        assert client.num_tracked_requests == 1   # nothing written for the refused ones
        # A request whose sequences would take ids a running request has:
        blocker = await client.add_request("B", SamplingParams(max_tokens=50, ignore_eos=True), "w#1")
        try:
            await client.add_request("B", SamplingParams(n=2, max_tokens=2), "w")
        except ValueError as e:
            refused.append(str(e))
        finally:
            blocker.abort()
        return refused, await _collect(victim)

    refused, finish = _run(server, scenario())
    assert len(refused) == 4 and all("already in use" in m for m in refused), refused
    assert finish == {0: "length", 1: "length"}
    assert wait_until(lambda: client.num_tracked_requests == 0 and _idle_and_free(server))


def test_a_request_the_core_rejects_leaves_the_others_running(server, monkeypatch):
    """The engine core refuses one request (as its own duplicate check would): that request's stream ends
    with the error, every other request finishes."""
    core = server.engine_client._transport.core
    real_add = core.add_request

    def add_request(command):
        if command.request_id == "rejected":
            raise ValueError("request_id: 'rejected' is already in use.")
        return real_add(command)

    monkeypatch.setattr(core, "add_request", add_request)
    client = server.engine_client

    async def scenario():
        params = SamplingParams(n=2, max_tokens=50, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        victim = await client.add_request("A", params, "bystander")
        rejected = await client.add_request("B", SamplingParams(n=2, max_tokens=2), "rejected")
        try:
            await _collect(rejected)
            error = None
        except ValueError as e:
            error = str(e)
        return error, await _collect(victim)

    error, finish = _run(server, scenario())
    assert error is not None and "already in use" in error
    assert finish == {0: "length", 1: "length"}
    assert wait_until(lambda: client.num_tracked_requests == 0 and client.num_sequences_in_flight == 0
                      and _idle_and_free(server))
