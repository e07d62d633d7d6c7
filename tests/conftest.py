"""Shared fixtures: tiny random checkpoints with a real byte-level BPE tokenizer, built offline.

NOTE: TRITON_INTERPRET must be set before anything imports triton, so it is set here, first.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One converted copy of the default GGUF model shared by every test run (and the server's subprocesses).
os.environ.setdefault("CHORUS_CACHE", str(__import__("pathlib").Path(__file__).resolve().parents[1] / ".cache" / "chorus"))

# Under pytest-xdist (the README's test command runs 2 workers) the workers share the CPUs: each
# worker's torch and BLAS get cores / workers threads (1 on CI's 2 cores). More oversubscribes the
# cores, and an OpenMP thread that waits for a descheduled peer makes a whole step wait.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)      # set in xdist workers only
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
_WORKER_THREADS = max(1, _CPUS // _XDIST_WORKERS) if _XDIST_WORKERS else 0
if _WORKER_THREADS:
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_var, str(_WORKER_THREADS))   # also read by subprocesses (servers)

import torch  # noqa: E402

if _WORKER_THREADS:
    torch.set_num_threads(_WORKER_THREADS)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import pytest  # noqa: E402

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "A scheduler hands out one token budget per step to running and waiting requests.",
    "Low-rank adapters add a small update to each projection of the base model.",
    "What is the capital of France? Paris is the capital of France.",
    "def add(a, b):\n    return a + b\n",
    "SELECT name FROM users WHERE id = 42;",
    "Chorus serves many adapters from one base model in one continuously batched engine.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20.",
    "Hello world! How are you today? I am fine, thank you.",
] * 4

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['content'] is string %}"
          "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}{{ '<image>' }}"
          "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

TINY_PROMPTS = [
    "The quick brown fox",
    "Hello",
    "Paged attention keeps the KV cache in fixed-size blocks. A scheduler hands out one token budget",
    "def add(a, b):",
    "What is the capital of France?",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20. Low-rank adapters add a small update "
    "to each projection of the base model. Chorus serves many adapters",
    "SELECT",
    "A",
]


def build_tokenizer(extra_special_tokens: tuple[str, ...] = ()):
    """The tiny BPE tokenizer (ChatML template); ``extra_special_tokens`` are added as single tokens
    (``("<think>", "</think>")`` for a reasoning model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", *extra_special_tokens]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=384, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>",
                                  additional_special_tokens=["<image>", *extra_special_tokens])
    tok.chat_template = CHATML
    return tok


def build_tiny_checkpoint(out_dir: Path, arch: str = "llama", seed: int = 0,
                          extra_special_tokens: tuple[str, ...] = (), **overrides) -> Path:
    """Save a tiny random ``arch`` model + tokenizer to ``out_dir`` (HF layout)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = build_tokenizer(extra_special_tokens)
    kwargs = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                  max_position_embeddings=512, eos_token_id=tok.eos_token_id,
                  bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    kwargs.update(overrides)
    cfg = AutoConfig.for_model(arch, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_thinking_dir(tmp_path_factory) -> Path:
    """A tiny llama whose tokenizer has ``<think>`` and ``</think>`` as single tokens (reasoning parsers)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-thinking"), "llama",
                                 extra_special_tokens=("<think>", "</think>"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_prompts() -> list[str]:
    return list(TINY_PROMPTS)


# ------------------------------------------------------------------------------------------
# pytest-xdist work units (the README's test command runs ``-n 2 --dist loadgroup``)
# ------------------------------------------------------------------------------------------
PER_TEST_DIRS = ("tests/kernels/",)
"""Scheduled test by test (most of the run's time, in many short tests: they balance the workers'
ends): no fixture there is wider than a function, beyond this file's session-scoped checkpoints,
which each worker builds once."""
DEFAULT_MODEL_TESTS = ("tests/models/test_smollm2.py::", "tests/lora/test_smollm2_lora.py::",
                       "tests/server/test_cli.py::test_readme_serve_command_default_smollm2",
                       "tests/server/test_tool_calling_smollm2.py::",
                       "tests/structured_output/test_smollm2_engine.py::",
                       "tests/structured_output/test_smollm2_schemas.py::",
                       "tests/structured_output/test_server_response_format.py::")
"""The tests of the real SmolLM2 default model (shared CHORUS_CACHE): one work unit, so a clean
cache converts the GGUF once, on one worker, not on both at the same time."""


def work_unit(nodeid: str) -> Optional[str]:
    """The xdist work unit of a test: the default-model group, its module elsewhere (module-scoped
    servers, engines and references are built once), or None (the test alone)."""
    if nodeid.startswith(DEFAULT_MODEL_TESTS):
        return "default-model"
    if nodeid.startswith(PER_TEST_DIRS):
        return None
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` over ``work_unit``'s units (the tests it leaves alone: xdist's own rule).

    NOTE: a scheduler, not ``xdist_group`` marks added at collection: with pytest 9.2 xdist can no
    longer tag node ids with their group (pytest-dev/pytest-xdist#1386), and the controller, which
    schedules, sees only node ids. Units go out biggest (most tests) first and single tests last,
    so the two workers end close together."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class WorkUnitScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid) or super()._split_scope(nodeid)

    return WorkUnitScheduling(config, log)
