"""benchmarks/serve.py's own bookkeeping against a fake streaming server (no model): token-id
prompts from a workload file, requests split over client processes, client CPU, served / offline."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.benchmark_module import load_benchmark

FAKE_SERVER = r'''
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        body = json.dumps({"data": [{"id": "fake"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions":
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n_prompt = len(req["prompt"]) if isinstance(req["prompt"], list) else 1
        for i in range(req["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": f"t{i} "}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": req["max_tokens"]}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def fake_server():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", FAKE_SERVER, str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                httpx.get(url + "/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _load_serve():
    return load_benchmark("serve.py", "bench_serve_unit")   # registered: dataclasses look their module up there


@pytest.mark.parametrize("num_clients", [1, 3])
def test_token_id_workload_over_client_processes(fake_server, tmp_path, num_clients):
    bench = _load_serve()
    workload = tmp_path / "workload.jsonl"
    workload.write_text("".join(json.dumps({"prompt": [5 + i] * (3 + i), "output_len": 2 + i % 3}) + "\n"
                                for i in range(7)))
    offline = tmp_path / "offline.json"
    offline.write_text(json.dumps({"rows": [{"output_tok_s": 100.0, "output_tokens": 20}]}))
    s = bench.main(["--base-url", fake_server, "--dataset", str(workload), "--num-prompts", "7",
                    "--num-clients", str(num_clients), "--offline-json", str(offline),
                    "--out", str(tmp_path / "r.json")])
    assert s["completed"] == 7 and s["failed"] == 0
    assert s["total_output_tokens"] == sum(2 + i % 3 for i in range(7)) == 20
    assert s["total_input_tokens"] == sum(3 + i for i in range(7))
    assert s["num_clients"] == num_clients and len(s["client_cpu_s"]) == num_clients
    assert 0 < s["client_cpu_fraction_max"] < 2
    assert s["served_over_offline"] == pytest.approx(s["output_throughput"] / 100.0)
    assert json.loads((tmp_path / "r.json").read_text())["num_clients"] == num_clients
