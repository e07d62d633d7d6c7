"""engine.host_memory: freed activations stay mapped between CPU steps (glibc only)."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from engine.host_memory import keep_freed_host_memory, register_pinned_host_memory

ROOT = Path(__file__).resolve().parents[2]

# A step's pattern in miniature: four 20 MiB activations live at once, written, then freed; the minor
# page faults of the third such step, before and after keep_freed_host_memory(), in one fresh process.
_STEPS = r"""
import ctypes, importlib.util, resource, sys
spec = importlib.util.spec_from_file_location("host_memory", sys.argv[1] + "/engine/host_memory.py")
host_memory = importlib.util.module_from_spec(spec); spec.loader.exec_module(host_memory)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def step():
    blocks = [libc.malloc(20 << 20) for _ in range(4)]
    for b in blocks:
        ctypes.memset(b, 1, 20 << 20)
    for b in blocks:
        libc.free(b)
def third_step_faults():
    step(); step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
default = third_step_faults()
print(host_memory.keep_freed_host_memory(), default, third_step_faults())
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_activations_are_reused_without_page_faults():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _STEPS, str(ROOT)], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    applied, default_faults, kept_faults = out[0], int(out[1]), int(out[2])
    assert applied == "True"
    pages = 4 * (20 << 20) // 4096
    assert default_faults > pages // 2          # glibc's defaults give most of the 80 MiB back each step
    assert kept_faults < pages // 20            # kept: the step reuses its freed blocks


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_environment_tuning_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "65536")
    assert keep_freed_host_memory() is False
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    assert keep_freed_host_memory() is False


def test_pinned_memory_registered_unless_the_environment_sets_pinned_options(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,pinned_use_background_threads:True")
    assert register_pinned_host_memory() is False
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "pinned_num_register_threads:4")
    assert register_pinned_host_memory() is False
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert register_pinned_host_memory() is True     # PyTorch took the setting (a CPU build parses it too)
