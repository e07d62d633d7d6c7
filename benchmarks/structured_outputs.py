"""Structured outputs: the same chat requests with a JSON schema each (the mixed set of
``tests/structured_output/schemas.py``, cycled) and unconstrained, side by side in one run.

Examples:
    # CPU, the default SmolLM2-135M-Instruct: offline batch 16, then 16 concurrent clients (chorus serve)
    python benchmarks/structured_outputs.py --num-prompts 32 --batch-size 16 --serve-clients 16
    # H200, a Llama-3-8B-shaped model with random bf16 weights
    python benchmarks/structured_outputs.py --llama3-8b-dummy --batch-size 64 --num-prompts 256 \
        --serve-clients 64

Offline (``LLM.chat``, ``max_num_seqs`` = ``--batch-size``, greedy): the constrained side runs first, each
request to ``--output-len`` tokens or the end of its grammar, whichever comes first; the unconstrained side
then replays each request's output length with ``ignore_eos`` (``--free-len replay``), so both sides decode
the same tokens in the same batches and the ratio of their output tok/s is the cost of the constraints
(``--free-len fixed``: ``--output-len`` tokens each; compare tok/s, the mean lengths differ). ``--rounds``
pairs alternate their order (the host's speed drifts); the ratio is over the totals, with each round's
beside it. Every schema is compiled in an untimed warm-up first (schemas the chosen backend refuses are left
out and named). Decode-step overhead per request: (t_constrained - t_free) / output tokens (one output token
is one request in one decode step), and the engine's host grammar work per constrained row of a step
(filling its bitmask row, taking its sampled token), timed inside the engine.

Served (``--serve-clients N``, 0: skip): ``chorus serve`` with the same model flags as a subprocess; N
concurrent clients (httpx) send the requests as chat completions with ``response_format`` json_schema, then
the same requests unconstrained with the constrained replies' lengths and ``ignore_eos``.

Compile time (``GrammarCompilePool`` on the model's tokenizer and the engine's backend, ``auto`` by default):
each schema of the set in ``--compile-rounds`` variants (a ``$comment`` makes each a new spec); cold is the
first compile of a spec, cached is the same spec again (the pool's cache), as p50 / p99; the backends' set-up
(reading the tokenizer: building the pool for a named backend, the first compile of each under ``auto``) is
reported apart.

``--llama3-8b-dummy``: the Llama-3-8B shape with a byte-level BPE tokenizer trained here on the Python
standard library's source (about 123k tokens, in a 128256-wide vocabulary; the rest are never allowed), so
the grammars run over a vocabulary of Llama 3's size with real multi-character tokens; under $TMPDIR
(default /tmp). Prints tables, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DUMMY_DIR_NAME = "chorus-llama3-8b-dummy-bpe"
"""The ``--llama3-8b-dummy`` checkpoint directory under $TMPDIR."""
BPE_SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
"""The dummy tokenizer's special tokens (ids 0-3): BOS, EOS and the chat template's headers."""
BPE_CHAT_TEMPLATE = ("{{ '<|begin_of_text|>' }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
                     "'<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}{% endfor %}"
                     "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
                     "{% endif %}")
"""Llama 3's chat format."""
BPE_VOCAB_SIZE = 128000
"""Tokens the BPE trainer aims at (the standard library's source runs out a little before)."""


def llama3_8b_bpe_dummy() -> str:
    """The Llama-3-8B-shaped config (random weights through ``load_format=dummy``) with a byte-level BPE
    tokenizer trained on the Python standard library's ``.py`` files, written once under $TMPDIR."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from benchmarks.throughput import LLAMA3_8B, dummy_checkpoint

    out_dir = Path(os.environ.get("TMPDIR", "/tmp")) / DUMMY_DIR_NAME
    if not (out_dir / "tokenizer.json").is_file():
        import sysconfig
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
        tk = Tokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, special_tokens=BPE_SPECIALS,
                                      show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tk.train_from_iterator((p.read_bytes().decode("utf-8", "replace") for p in files), trainer)
        tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=BPE_SPECIALS[0],
                                      eos_token=BPE_SPECIALS[1], additional_special_tokens=BPE_SPECIALS[2:])
        tok.chat_template = BPE_CHAT_TEMPLATE
        out_dir.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(out_dir)
    return str(dummy_checkpoint(out_dir, "bfloat16", dict(LLAMA3_8B, bos_token_id=0, eos_token_id=1)))


def requests_of(schemas: list[Any], num_prompts: int) -> list[Any]:
    """``num_prompts`` cases of ``schemas``, cycled."""
    return [schemas[i % len(schemas)] for i in range(num_prompts)]


def compiling_schemas(pool: Any) -> tuple[list[Any], list[str]]:
    """The schemas of the set that ``pool`` (the engine's) compiles, and the names of the others (a named
    backend may refuse some: xgrammar does not enforce ``allOf``)."""
    from engine.structured_output.errors import StructuredOutputError
    from engine.structured_output.params import StructuredOutputsParams
    from tests.structured_output.schemas import SCHEMAS
    ok, refused = [], []
    for case in SCHEMAS:
        try:
            pool.validate(StructuredOutputsParams(json=case.schema))
            ok.append(case)
        except StructuredOutputError:
            refused.append(case.name)
    return ok, refused


def percentiles(values: list[float]) -> dict[str, float]:
    """p50 / p99 / mean / max / count (nearest rank) of ``values``."""
    ordered = sorted(values)
    if not ordered:
        return dict(p50=None, p99=None, mean=None, max=None, n=0)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered) + 0.5)) - 1))]
    return dict(p50=rank(50), p99=rank(99), mean=statistics.fmean(ordered), max=ordered[-1], n=len(ordered))


def validity(cases: list[Any], texts: list[str]) -> Optional[int]:
    """How many ``texts`` are JSON that validates their case's schema (None without jsonschema)."""
    try:
        import jsonschema
    except ImportError:
        return None
    valid = 0
    for case, text in zip(cases, texts):
        try:
            jsonschema.validate(json.loads(text), case.schema)
        except (ValueError, jsonschema.ValidationError):
            continue
        valid += 1
    return valid


def side_row(name: str, seconds: float, lengths: list[int], finish: list[str], steps: int) -> dict:
    tokens = sum(lengths)
    return dict(side=name, seconds=seconds, requests=len(lengths), output_tokens=tokens,
                output_tok_s=tokens / seconds, mean_output_len=tokens / max(1, len(lengths)),
                finished_stop=sum(f == "stop" for f in finish), steps=steps)


class GrammarTimer:
    """Wraps a ``StructuredOutputManager``'s ``fill_bitmask`` and ``accept_tokens`` (instance attributes):
    host seconds spent in each and the constrained rows they handled."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.fill_s = self.accept_s = 0.0
        self.rows = self.accepts = 0
        fill, accept = manager.fill_bitmask, manager.accept_tokens

        def timed_fill(rows):
            t0 = time.perf_counter()
            result = fill(rows)
            self.fill_s += time.perf_counter() - t0
            self.rows += len(result.row_indices) if result is not None else 0
            return result

        def timed_accept(req_id, token_ids):
            t0 = time.perf_counter()
            result = accept(req_id, token_ids)
            self.accept_s += time.perf_counter() - t0
            self.accepts += 1
            return result
        manager.fill_bitmask, manager.accept_tokens = timed_fill, timed_accept

    def reset(self) -> None:
        self.fill_s = self.accept_s = 0.0
        self.rows = self.accepts = 0

    def summary(self) -> dict:
        return dict(fill_bitmask_s=self.fill_s, accept_tokens_s=self.accept_s, bitmask_rows=self.rows,
                    accepts=self.accepts,
                    host_us_per_row=(self.fill_s + self.accept_s) / self.rows * 1e6 if self.rows else None)

    def close(self) -> None:
        del self.manager.fill_bitmask, self.manager.accept_tokens


def run_offline(llm: Any, args: argparse.Namespace, schemas: list[Any]) -> dict:
    """Constrained then unconstrained ``LLM.chat`` of the same requests (module docstring)."""
    from engine import SamplingParams
    from engine.structured_output.params import StructuredOutputsParams

    cases = requests_of(schemas, args.num_prompts)
    convs = [[{"role": "user", "content": c.prompt}] for c in cases]

    def constrained(case: Any, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=max_tokens,
                              structured_outputs=StructuredOutputsParams(json=case.schema))

    # Untimed: every schema compiles (into the engine's cache), and both kinds of step run once.
    llm.chat([[{"role": "user", "content": c.prompt}] for c in schemas],
             [constrained(c, 8) for c in schemas], use_tqdm=False)
    llm.chat(convs[:args.batch_size], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
             use_tqdm=False)
    timer = GrammarTimer(llm.llm_engine.scheduler.structured_output)

    def timed_chat(params: list[Any]) -> tuple[float, list[Any], int]:
        steps0 = llm.llm_engine.get_stats().num_steps
        t0 = time.perf_counter()
        outs = llm.chat(convs, params, use_tqdm=False)
        return time.perf_counter() - t0, outs, llm.llm_engine.get_stats().num_steps - steps0

    def constrained_side() -> tuple[dict, list[int]]:
        timer.reset()
        seconds, outs, steps = timed_chat([constrained(c, args.output_len) for c in cases])
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        row = side_row("constrained", seconds, lengths, [o.outputs[0].finish_reason for o in outs], steps)
        row["valid_json"] = validity(cases, [o.outputs[0].text for o in outs])
        row.update(timer.summary())
        return row, lengths

    def free_side(lengths: list[int]) -> dict:
        seconds, outs, steps = timed_chat([SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                           for n in lengths])
        return side_row("unconstrained", seconds, [len(o.outputs[0].token_ids) for o in outs],
                        [o.outputs[0].finish_reason for o in outs], steps)
    try:
        return summarize(alternate(args, constrained_side, free_side))
    finally:
        timer.close()


def alternate(args: argparse.Namespace, constrained_side: Any, free_side: Any) -> list[dict]:
    """``--rounds`` pairs of runs: constrained first in round 0 (its output lengths are the ones the free
    side replays), then the order alternates, so a drift of the host's speed weighs on both sides."""
    rounds = []
    lengths: Optional[list[int]] = None
    for i in range(args.rounds):
        if i % 2 == 0:
            row_c, got = constrained_side()
            lengths = lengths or got
        free_lens = lengths if args.free_len == "replay" else [args.output_len] * len(lengths)
        row_f = free_side(free_lens)
        if i % 2 == 1:
            row_c, _ = constrained_side()
        rounds.append({"constrained": row_c, "unconstrained": row_f,
                       "ratio": row_c["output_tok_s"] / row_f["output_tok_s"]})
    return rounds


def summarize(rounds: list[dict]) -> dict:
    """Totals over the rounds: tok/s of each side, their ratio, and the overhead per request-step."""
    def total(side: str, key: str) -> float:
        return sum(r[side][key] for r in rounds)
    c_s, f_s = total("constrained", "seconds"), total("unconstrained", "seconds")
    c_tok, f_tok = total("constrained", "output_tokens"), total("unconstrained", "output_tokens")
    c_steps = total("constrained", "steps")
    out = dict(rounds=rounds, constrained_tok_s=c_tok / c_s, unconstrained_tok_s=f_tok / f_s,
               ratio=(c_tok / c_s) / (f_tok / f_s),
               round_ratios=[r["ratio"] for r in rounds],
               median_round_ratio=statistics.median(r["ratio"] for r in rounds),
               mean_output_len_constrained=c_tok / total("constrained", "requests"),
               mean_output_len_unconstrained=f_tok / total("unconstrained", "requests"))
    # Each output token is one request in one decode step: the time a constrained one costs beyond a free
    # one, per request per step (meaningful when both sides decode the same tokens: --free-len replay).
    out["overhead_us_per_request_step"] = (c_s / c_tok - f_s / f_tok) * 1e6
    out["overhead_ms_per_step"] = (c_s - f_s * c_tok / f_tok) / c_steps * 1e3 if c_steps else None
    rows = [r["constrained"] for r in rounds if r["constrained"].get("bitmask_rows")]
    if rows:
        host = sum(r["fill_bitmask_s"] + r["accept_tokens_s"] for r in rows)
        out["host_grammar_us_per_row"] = host / sum(r["bitmask_rows"] for r in rows) * 1e6
        out["host_grammar_share"] = host / c_s
    return out


def compile_times(tokenizer: Any, vocab_size: int, stop_ids: list[int], backend: str, rounds: int,
                  schemas: list[Any]) -> dict:
    """Cold and cached compile times of the schema set on a fresh ``GrammarCompilePool`` (module
    docstring), in ms, and the first compiles' set-up of each backend."""
    from engine.structured_output.compiler import GrammarCompilePool
    from engine.structured_output.params import StructuredOutputsParams
    from engine.structured_output.errors import StructuredOutputError

    t0 = time.perf_counter()
    pool = GrammarCompilePool.for_tokenizer(tokenizer, vocab_size, backend, stop_ids)
    setup = {"pool": time.perf_counter() - t0}   # a named backend reads the tokenizer here, auto on first use
    # The first compile of each backend reads the tokenizer (the allOf: guidance, under auto).
    for schema in ({"type": "object", "properties": {"a": {"type": "integer"}}},
                   {"allOf": [{"type": "object"}, {"required": ["a"]}]}):
        t0 = time.perf_counter()
        try:
            grammar = pool.submit(StructuredOutputsParams(json=schema)).result()
        except StructuredOutputError:
            continue
        setup.setdefault(grammar.backend, time.perf_counter() - t0)
    cold: list[float] = []
    cached: list[float] = []
    by_backend: dict[str, int] = {}
    for r in range(rounds):
        for case in schemas:
            params = StructuredOutputsParams(json={"$comment": f"variant {r}", **case.schema})
            t0 = time.perf_counter()
            grammar = pool.submit(params).result()
            cold.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            pool.submit(params).result()
            cached.append((time.perf_counter() - t0) * 1e3)
            by_backend[grammar.backend] = by_backend.get(grammar.backend, 0) + 1
    pool.shutdown()
    return dict(backend=backend, cold_ms=percentiles(cold), cached_ms=percentiles(cached),
                backend_setup_s=setup, compiled_by=by_backend, cache_hits=pool.cache_hits,
                cache_misses=pool.cache_misses)


async def _serve_side(url: str, model: str, bodies: list[dict], clients: int) -> tuple[float, list[dict]]:
    """``bodies`` as chat completions from ``clients`` concurrent clients, each sending one after another;
    seconds of the whole and the replies (in order)."""
    import httpx
    replies: list[Optional[dict]] = [None] * len(bodies)
    next_index = iter(range(len(bodies)))

    async def client(http: httpx.AsyncClient) -> None:
        for i in next_index:
            resp = await http.post(url + "/v1/chat/completions", json=dict(bodies[i], model=model))
            resp.raise_for_status()
            replies[i] = resp.json()
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0),
                                 limits=httpx.Limits(max_connections=clients)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        seconds = time.perf_counter() - t0
    return seconds, replies


def serve_row(name: str, seconds: float, replies: list[dict]) -> dict:
    lengths = [r["usage"]["completion_tokens"] for r in replies]
    return side_row(name, seconds, lengths, [r["choices"][0]["finish_reason"] for r in replies], steps=0)


def run_served(args: argparse.Namespace, model_args: list[str], schemas: list[Any]) -> dict:
    """``chorus serve`` as a subprocess; constrained then unconstrained requests from
    ``--serve-clients`` concurrent clients (module docstring)."""
    import signal
    import socket
    import subprocess

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # `python -m engine.cli` (what `chorus` runs): also where the package is not installed (the GPU image).
    cmd = [sys.executable, "-m", "engine.cli", "serve", *model_args, "--port", str(port), "--host", "127.0.0.1",
           "--disable-log-requests", *args.serve_args.split()]
    log = open(args.serve_log, "w") if args.serve_log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1])
    url = f"http://127.0.0.1:{port}"
    cases = requests_of(schemas, args.num_prompts)

    def body(case: Any, max_tokens: int, constrained: bool) -> dict:
        b = dict(messages=[{"role": "user", "content": case.prompt}], max_tokens=max_tokens, temperature=0)
        if constrained:
            b["response_format"] = {"type": "json_schema",
                                    "json_schema": {"name": case.name, "schema": case.schema}}
        else:
            b["ignore_eos"] = True
        return b
    try:
        t0 = time.perf_counter()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"chorus serve exited with {proc.returncode} ({' '.join(cmd)})")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > args.serve_start_timeout:
                raise RuntimeError("chorus serve did not become healthy")
            time.sleep(0.2)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        warm = [body(c, 8, True) for c in schemas] + [body(c, 8, False) for c in cases[:args.serve_clients]]
        asyncio.run(_serve_side(url, model, warm, args.serve_clients))

        def constrained_side() -> tuple[dict, list[int]]:
            seconds, replies = asyncio.run(_serve_side(
                url, model, [body(c, args.output_len, True) for c in cases], args.serve_clients))
            row = serve_row("constrained", seconds, replies)
            row["valid_json"] = validity(cases, [r["choices"][0]["message"]["content"] for r in replies])
            return row, [r["usage"]["completion_tokens"] for r in replies]

        def free_side(lengths: list[int]) -> dict:
            seconds, replies = asyncio.run(_serve_side(
                url, model, [body(c, n, False) for c, n in zip(cases, lengths)], args.serve_clients))
            return serve_row("unconstrained", seconds, replies)
        rounds = alternate(args, constrained_side, free_side)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    out = summarize(rounds)
    out.update(clients=args.serve_clients, command=" ".join(cmd[1:]))
    return out


def print_side_by_side(title: str, s: dict) -> None:
    print(f"\n{title}")
    print(f"{'round':>5s} {'side':14s} {'requests':>8s} {'seconds':>8s} {'out tokens':>10s} "
          f"{'out tok/s':>10s} {'mean len':>8s} {'stop':>5s} {'valid':>5s} {'steps':>6s} {'ratio':>6s}")
    for i, r in enumerate(s["rounds"]):
        for side in ("constrained", "unconstrained"):
            x = r[side]
            valid = "-" if x.get("valid_json") is None else str(x["valid_json"])
            ratio = f"{r['ratio']:6.3f}" if side == "constrained" else ""
            print(f"{i:5d} {side:14s} {x['requests']:8d} {x['seconds']:8.2f} {x['output_tokens']:10d} "
                  f"{x['output_tok_s']:10.1f} {x['mean_output_len']:8.1f} {x['finished_stop']:5d} "
                  f"{valid:>5s} {x['steps'] or '-':>6} {ratio}")
    line = (f"constrained / unconstrained tok/s: {s['ratio']:.3f} (median of rounds "
            f"{s['median_round_ratio']:.3f}); overhead per request per decode step: "
            f"{s['overhead_us_per_request_step']:.1f} us")
    if s.get("overhead_ms_per_step") is not None:
        line += f" ({s['overhead_ms_per_step']:.2f} ms per step)"
    if s.get("host_grammar_us_per_row") is not None:
        line += (f"; engine host grammar work {s['host_grammar_us_per_row']:.1f} us per constrained row "
                 f"({100 * s['host_grammar_share']:.1f}% of the constrained run)")
    print(line)


def print_compile(c: dict) -> None:
    setup = ", ".join(f"{k} {v:.2f} s" for k, v in c["backend_setup_s"].items())
    print(f"\nschema compile ({c['backend']} backend; compiled by {c['compiled_by']}); set-up (the pool, "
          f"the first compile of each backend): {setup}")
    print(f"{'':8s} {'n':>5s} {'p50 ms':>9s} {'p99 ms':>9s} {'mean ms':>9s} {'max ms':>9s}")
    for name in ("cold", "cached"):
        p = c[f"{name}_ms"]
        print(f"{name:8s} {p['n']:5d} {p['p50']:9.3f} {p['p99']:9.3f} {p['mean']:9.3f} {p['max']:9.3f}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--llama3-8b-dummy", action="store_true",
                    help="Llama-3-8B shape, random weights, a BPE tokenizer of ~123k tokens")
    ap.add_argument("--batch-size", type=int, default=16,
                    help="max_num_seqs of the engine (offline and served)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=256, help="max_tokens of the constrained requests")
    ap.add_argument("--free-len", choices=["replay", "fixed"], default="replay",
                    help="unconstrained lengths: the constrained ones (replay) or --output-len (fixed)")
    ap.add_argument("--rounds", type=int, default=1, help="constrained + unconstrained runs of each mode")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--structured-outputs-backend", default="auto", choices=["auto", "xgrammar", "guidance"])
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--serve-clients", type=int, default=0,
                    help="concurrent clients through chorus serve (0: skip)")
    ap.add_argument("--serve-args", default="", help="extra `chorus serve` flags")
    ap.add_argument("--serve-log", default=None, help="file for the server's output (default: discarded)")
    ap.add_argument("--serve-start-timeout", type=float, default=600.0)
    ap.add_argument("--compile-rounds", type=int, default=4,
                    help="variants of each schema compiled (0: skip)")
    ap.add_argument("--out", default="benchmarks/out/structured_outputs.json")
    return ap


def main(argv: Optional[list[str]] = None) -> dict:
    args = build_parser().parse_args(argv)
    load_format = "auto"
    if args.llama3_8b_dummy:
        args.model = llama3_8b_bpe_dummy()
        load_format = "dummy"
    engine_kw: dict[str, Any] = dict(max_num_seqs=args.batch_size, max_model_len=args.max_model_len,
                                     dtype=args.dtype, seed=0,
                                     structured_outputs_backend=args.structured_outputs_backend)
    if load_format == "dummy":
        engine_kw["load_format"] = "dummy"
    model_args = ([args.model] if args.model else []) + [
        "--max-num-seqs", str(args.batch_size), "--max-model-len", str(args.max_model_len),
        "--dtype", args.dtype,
        "--structured-outputs-backend", args.structured_outputs_backend,
        *(["--load-format", "dummy"] if load_format == "dummy" else [])]
    result: dict[str, Any] = dict(args=vars(args), date=time.strftime("%Y-%m-%d"))
    import torch
    result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() \
        else f"cpu x{torch.get_num_threads()}"
    from tests.structured_output.schemas import SCHEMAS
    schemas = list(SCHEMAS)
    if not args.skip_offline or args.compile_rounds:
        from engine import LLM
        t0 = time.perf_counter()
        llm = LLM(args.model, **engine_kw)
        result["load_s"] = time.perf_counter() - t0
        engine = llm.llm_engine
        tokenizer = llm.get_tokenizer()
        result["model"] = engine.model_name
        result["tokenizer_vocab"] = len(tokenizer)
        result["logits_vocab"] = engine.scheduler.structured_output.compile_pool.vocab_size
        pool = engine.scheduler.structured_output.compile_pool
        schemas, result["refused_schemas"] = compiling_schemas(pool)
        if args.compile_rounds:
            result["compile"] = compile_times(tokenizer, result["logits_vocab"],
                                              sorted(engine.processor.eos_token_ids),
                                              args.structured_outputs_backend, args.compile_rounds, schemas)
        if not args.skip_offline:
            result["offline"] = run_offline(llm, args, schemas)
        llm.llm_engine.close()
        del llm, engine
        import gc
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()   # the served engine's memory profile sees the whole device
    if args.serve_clients:
        result["served"] = run_served(args, model_args, schemas)
    cycled = len({c.name for c in requests_of(schemas, args.num_prompts)})
    print(f"\nmodel {result.get('model', args.model or 'default')} (tokenizer "
          f"{result.get('tokenizer_vocab')} tokens, logits {result.get('logits_vocab')}), device "
          f"{result['device']}; {args.num_prompts} requests cycling {cycled} JSON schemas, output <= "
          f"{args.output_len} tokens, batch {args.batch_size}, unconstrained lengths: {args.free_len}")
    if result.get("refused_schemas"):
        print(f"the {args.structured_outputs_backend} backend refuses "
              f"{', '.join(result['refused_schemas'])}: left out")
    if "offline" in result:
        print_side_by_side(f"offline LLM.chat, batch {args.batch_size}", result["offline"])
    if "served" in result:
        print_side_by_side(f"chorus serve, {args.serve_clients} concurrent clients", result["served"])
    if "compile" in result:
        print_compile(result["compile"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
