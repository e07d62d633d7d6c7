"""Our top-level packages shadow PyPI names (kernels, lora, encoders, multimodal): prove ours load,
and that transformers does not take our ``kernels`` for its optional hub-kernels dependency."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_our_packages_are_imported():
    import encoders
    import kernels
    import lora
    import multimodal

    for mod in (kernels, lora, encoders, multimodal):
        assert Path(mod.__file__).resolve().parent.parent == REPO, mod.__file__
    assert hasattr(lora, "LoRARequest") and lora.NO_LORA == -1
    assert kernels.__doc__ and "Chorus" in kernels.__doc__


def test_transformers_does_not_use_our_kernels_package():
    # A fresh interpreter: is_kernels_available() is lru-cached per process.
    code = (
        "from transformers.utils.import_utils import is_kernels_available\n"
        "import sys\n"
        "assert not is_kernels_available(), 'transformers thinks hub kernels are installed'\n"
        "import transformers.integrations.hub_kernels as hk\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,"
        " num_attention_heads=2, vocab_size=64))\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")
