"""The ``chorus`` command: ``serve`` (OpenAI-compatible server: a chat model, a Whisper model, or both),
``generate`` (one prompt, offline), ``bench`` (the serving load generator in ``benchmarks/serve.py``)."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback
from pathlib import Path
from typing import NoReturn, Optional

SERVE_EPILOG = (
    "exit status: 0 after a clean shutdown (SIGTERM/SIGINT); 2 when a flag, a path, a file or the port "
    "cannot work (one line on stderr, 'chorus serve: error: ...', naming the flag and the fix; nothing was "
    "served); 1 when anything else stops it before it serves (one line; --debug prints the traceback) or "
    "when the engine dies while serving.")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``chorus serve: error: ...``, status 2), not the usage."""

    def error(self, message: str) -> NoReturn:
        hint = f"; `{self.prog} --help` lists them" if message.startswith("unrecognized arguments") else ""
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


def _serve(args: argparse.Namespace) -> int:
    from engine.server.app import StartupError, run_server
    try:
        run_server(args)
    except KeyboardInterrupt:
        pass
    except StartupError as e:
        if args.debug:
            traceback.print_exception(e.__cause__ or e)
        print(f"chorus serve: error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams
    llm = LLM(model=args.model, max_model_len=args.max_model_len, seed=args.seed, dtype=args.dtype,
              quantization=args.quantization)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed if args.temperature > 0 else None)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate([args.prompt], params, use_tqdm=False)
    llm.close()
    if outputs[0].error is not None:
        print(f"chorus generate: error: {outputs[0].error}", file=sys.stderr)
        return 1
    print(outputs[0].outputs[0].text)
    return 0


def _bench(argv: list[str]) -> int:
    """Run ``benchmarks/serve.py`` (a source checkout ships it next to ``engine/``)."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "serve.py"
    if not script.exists():
        print(f"chorus bench: {script} not found; run benchmarks/serve.py from a source checkout.",
              file=sys.stderr)
        return 2
    if argv and argv[0] == "serve":
        argv = argv[1:]
    sys.argv = [str(script), *argv]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from engine.server.args import add_serve_args
    parser = _Parser(prog="chorus", description="Chorus LLM serving engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve", help="Serve a model over an OpenAI-compatible HTTP API.",
        description="Serve a model over an OpenAI-compatible HTTP API (vLLM's flags): chat and completions "
                    "for a chat MODEL; /v1/audio/transcriptions and /v1/audio/translations for a Whisper "
                    "MODEL (--task transcription without MODEL: Whisper tiny.en), or for a Whisper model "
                    "served next to a chat MODEL with --transcription-model.",
        epilog=SERVE_EPILOG, formatter_class=argparse.HelpFormatter)
    add_serve_args(serve)

    gen = sub.add_parser("generate", help="Complete one prompt offline and print the text.")
    gen.add_argument("--model", default=None, help="Model path (default: SmolLM2-135M-Instruct).")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="Send the prompt as a user message through the "
                                                         "chat template.")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--quantization", "-q", default=None, choices=["none", "int8", "int4", "fp16"],
                     help="weights in memory on CPU (as `chorus serve`): default keeps a GGUF file's "
                          "quantization; none = float (exact); int8 / int4 / fp16 = convert any Llama-family model")

    sub.add_parser("bench", help="Load-test an OpenAI-compatible server (benchmarks/serve.py; "
                                 "`chorus bench --help` for its flags).", add_help=False)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "generate":
        return _generate(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
