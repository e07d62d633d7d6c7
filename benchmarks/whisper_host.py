"""Host time of one Whisper decode step by phase: where the Python of a large batch goes.

Example (the 2-core CPU machine; tiny.en, real weights):
    python benchmarks/whisper_host.py --num-requests 256 512 --out benchmarks/out/whisper_host.json
    # H200: the same with CUDA graphs
    python benchmarks/whisper_host.py --device cuda --num-requests 256 512 1024

``--num-requests`` transcriptions of the committed speech clips (tests/data/audio) with ``ignore_eos`` and
a length cap past the timed steps, so every request decodes through them; ``--timestamps-every k`` asks
for timestamps on every k-th request (the logits rules' per-row path; 0: none, as ``benchmarks/whisper.py``).
The engine prefills them all, runs ``--warm-steps`` decode steps, then ``--steps`` timed ones. Each phase
is timed around the engine's own methods (wrapped on the instances; nothing in the engine changes):

  schedule        ``Scheduler.schedule``
  runner prep     the runner's step up to the forward: state diff, flat inputs, cross-attention metadata
  forward         the decoder (eager) or the graph replay, and the logits
  logits rules    Whisper's suppression / timestamp rules (``WhisperLogitsRules.apply``)
  sample          the sampler and the sampled ids' copy (rules excluded)
  update          ``Scheduler.update_from_output`` (waits for the step's ids)
  output          ``OutputProcessor.process``: detokenization, ``RequestOutput``s
  step            ``LLMEngine.step`` in all

``host`` is step minus forward: on CUDA the time the GPU would wait for Python if nothing overlapped; on
CPU the forward is the model's compute (and the torch backend's per-request cross-attention loop). Prints a
table (ms per step, mean over the timed steps) and writes JSON with ``--out``. ``--profile`` adds cProfile's
top functions of the timed steps by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

PHASES = ("schedule", "runner prep", "forward", "logits rules", "sample", "update", "output", "step", "host")


class PhaseTimer:
    """Accumulates wall seconds of wrapped callables by phase name."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        """Waits for the device (CUDA: the forward's kernels; a no-op on CPU) so a phase holds its own work."""
        self.seconds: dict[str, float] = defaultdict(float)
        """Wall seconds by phase."""
        self.cpu_seconds: dict[str, float] = defaultdict(float)
        """CPU seconds of the process (every thread) by phase: what a phase costs on a busy machine."""
        self.enabled = False

    def wrap(self, obj, name: str, phase: str, sync: bool = False) -> None:
        """Replace ``obj.name`` (a bound method) with a timed wrapper."""
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            if not self.enabled:
                return inner(*args, **kwargs)
            t0, c0 = time.perf_counter(), time.process_time()
            out = inner(*args, **kwargs)
            if sync:
                self.sync()
            self.seconds[phase] += time.perf_counter() - t0
            self.cpu_seconds[phase] += time.process_time() - c0
            return out

        setattr(obj, name, timed)


def _requests(engine, n: int, max_tokens: int, timestamps_every: int):
    """n transcription requests over the committed clips; timestamps on every ``timestamps_every``-th one."""
    from engine.sampling_params import SamplingParams
    from multimodal.whisper_decoding import build_decoder_prompt
    from tests.audio.whisper_reference import load_wav, speech_clips

    names = [c.name for c in speech_clips().values() if c.language == "en" and c.duration_s <= 30]
    clips = [load_wav(name)[0] for name in names]
    transcriber = engine.processor.transcriber
    prompts = {ts: build_decoder_prompt(transcriber.ids, transcriber.tokenizer, language=None, timestamps=ts)
               for ts in (False, True)}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [({"prompt_token_ids": prompts[timestamps_every > 0 and i % timestamps_every == 0],
              "multi_modal_data": {"audio": (clips[i % len(clips)], 16000)}}, params) for i in range(n)]


def run(args, num_requests: int) -> dict:
    from engine.llm import LLM
    from engine.loader.whisper_packages import whisper_model_dir

    path = whisper_model_dir(args.model) if not Path(args.model).is_dir() else Path(args.model)
    llm = LLM(model=str(path), device=args.device, dtype=args.dtype, max_num_seqs=num_requests,
              max_num_batched_tokens=max(8192, 4 * num_requests), gpu_memory_utilization=0.5,
              enforce_eager=args.enforce_eager)
    engine = llm.llm_engine
    core, runner = engine.core, engine.core.runner
    cuda = args.device == "cuda"
    timer = PhaseTimer(torch.cuda.synchronize if cuda else (lambda: None))
    timer.wrap(core.scheduler, "schedule", "schedule")
    timer.wrap(core.scheduler, "update_from_output", "update")
    timer.wrap(engine.output_processor, "process", "output")
    timer.wrap(runner, "_forward", "forward", sync=True)
    timer.wrap(runner.logits_rules, "apply", "logits rules", sync=True)
    timer.wrap(runner.sampling, "sample", "sample", sync=True)
    timer.wrap(runner, "_execute_async", "runner step")
    timer.wrap(engine, "step", "step", sync=True)
    for i, (prompt, params) in enumerate(_requests(engine, num_requests, args.warm_steps + args.steps + 20,
                                                         args.timestamps_every)):
        engine.add_request(str(i), prompt, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in runner.states.requests.values()) \
            or len(runner.states.requests) < num_requests:
        engine.step()                                   # encode and prefill every request
    print(f"{num_requests} requests prefilled", file=sys.stderr, flush=True)
    for _ in range(args.warm_steps):
        engine.step()
    profiler = cProfile.Profile() if args.profile else None
    timer.enabled = True
    if profiler is not None:
        profiler.enable()
    for _ in range(args.steps):
        engine.step()
    if profiler is not None:
        profiler.disable()
    timer.enabled = False
    row = dict(model=args.model, device=args.device, num_requests=num_requests, steps=args.steps,
               timestamps_every=args.timestamps_every, graphs=runner.graphs is not None,
               ms_per_step=_per_step(timer.seconds, args.steps),
               cpu_ms_per_step=_per_step(timer.cpu_seconds, args.steps))
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.profile_top)
        row["profile"] = out.getvalue()
        print(row["profile"])
    llm.close()
    return row


def _per_step(seconds: dict[str, float], steps: int) -> dict[str, float]:
    """Phase -> ms per step, with the derived phases: the runner's step minus its forward and sampling is its
    input preparation; sampling excludes the logits rules; host is the step minus the forward."""
    ms = {k: 1e3 * v / steps for k, v in seconds.items()}
    ms["runner prep"] = ms.pop("runner step", 0.0) - ms.get("forward", 0.0) - ms.get("sample", 0.0)
    ms["sample"] = ms.get("sample", 0.0) - ms.get("logits rules", 0.0)
    ms["host"] = ms["step"] - ms.get("forward", 0.0)
    return {p: round(ms.get(p, 0.0), 2) for p in PHASES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny.en", help="tiny.en, base or a Whisper directory")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps")
    ap.add_argument("--warm-steps", type=int, default=3)
    ap.add_argument("--timestamps-every", type=int, default=0, help="timestamps on every k-th request (0: none)")
    ap.add_argument("--enforce-eager", action="store_true", help="CUDA: no graphs")
    ap.add_argument("--profile", action="store_true", help="cProfile of the timed steps")
    ap.add_argument("--profile-top", type=int, default=30)
    ap.add_argument("--out", default=None, help="JSON file for every row")
    args = ap.parse_args()
    rows = [run(args, n) for n in args.num_requests]
    print(f"\nms per decode step ({args.model}, {args.device}, {args.steps} steps): wall / process CPU")
    print(f"{'requests':>9} " + " ".join(f"{p:>16}" for p in PHASES))
    for row in rows:
        print(f"{row['num_requests']:>9} " + " ".join(
            f"{row['ms_per_step'][p]:>8.2f}/{row['cpu_ms_per_step'][p]:<7.2f}" for p in PHASES))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps([{k: v for k, v in r.items() if k != "profile"} for r in rows],
                                             indent=1))


if __name__ == "__main__":
    main()
