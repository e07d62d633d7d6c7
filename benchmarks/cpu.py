"""The CPU path with the default model (SmolLM2-135M-Instruct GGUF): start-up, batch-1 decode, prefill.

Examples:
    python benchmarks/cpu.py                                  # float32 and int8, the default model
    python benchmarks/cpu.py --modes float32 bfloat16 int8 --out benchmarks/out/cpu.json

For each mode (float32; bfloat16; int8 = float32 activations with ``--quantization int8`` weights) in a
fresh process: ``LLM()`` construction time (the converted GGUF already cached), then one request of a
``--context-len``-token prompt of random ids decoding ``--decode-tokens`` tokens (greedy, EOS ignored):
decode tok/s from the first to the last token, prefill tok/s from its time to the first token, after an
untimed warm-up request. Threads: torch's default (the machine's cores) unless ``--threads``.
llama.cpp is not run here yet (issue #26 asks for it side by side).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run_mode(mode: str, args_dict: dict, queue) -> None:
    import numpy as np
    import torch

    from engine import LLM, SamplingParams
    from engine.sampling_params import RequestOutputKind
    if args_dict["threads"]:
        torch.set_num_threads(args_dict["threads"])
    kw = dict(max_model_len=args_dict["context_len"] + args_dict["decode_tokens"] + 16, enable_prefix_caching=False)
    if mode == "int8":
        kw.update(dtype="float32", quantization="int8")
    else:
        kw.update(dtype=mode)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    start_s = time.perf_counter() - t0
    engine = llm.llm_engine
    vocab = engine.runner.hf_config.get_text_config().vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=args_dict["decode_tokens"], ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    llm.generate({"prompt_token_ids": [int(t) for t in rng.integers(100, vocab - 100, 64)]},
                 SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    prompt = [int(t) for t in rng.integers(100, vocab - 100, args_dict["context_len"])]
    engine.add_request("bench", {"prompt_token_ids": prompt}, params)
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
            if n and first is None:
                first = time.perf_counter()
            tokens += n
            last = time.perf_counter()
    queue.put(dict(mode=mode, threads=torch.get_num_threads(), start_s=start_s,
                   prefill_tok_s=len(prompt) / (first - t0), decode_tok_s=(tokens - 1) / (last - first),
                   ms_per_token=(last - first) / (tokens - 1) * 1e3, context_len=len(prompt), tokens=tokens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["float32", "int8"], choices=["float32", "bfloat16", "int8"])
    ap.add_argument("--context-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for mode in args.modes:
        queue = ctx.Queue()
        proc = ctx.Process(target=run_mode, args=(mode, vars(args), queue))
        proc.start()
        rows.append(queue.get())
        proc.join()
    print(f"{'mode':10s} {'threads':>7s} {'LLM() s':>8s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'ms/token':>9s}")
    for r in rows:
        print(f"{r['mode']:10s} {r['threads']:7d} {r['start_s']:8.2f} {r['prefill_tok_s']:14.0f} "
              f"{r['decode_tok_s']:13.1f} {r['ms_per_token']:9.1f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(args=vars(args), rows=rows), indent=2))


if __name__ == "__main__":
    main()
