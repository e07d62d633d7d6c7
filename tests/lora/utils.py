"""Build PEFT adapters for tests, and the transformers + PEFT reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_peft_adapter(base_dir: Union[str, Path], out_dir: Union[str, Path], r: int, lora_alpha: float,
                       target_modules: Union[list[str], str], seed: int, use_rslora: bool = False,
                       base_model=None, **extra) -> Path:
    """Save a PEFT LoRA adapter with random non-zero A and B (``init_lora_weights=False``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = base_model if base_model is not None else AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules, lora_dropout=0.0,
                     task_type="CAUSAL_LM", init_lora_weights=False, use_rslora=use_rslora, **extra)
    peft_model = get_peft_model(base, cfg)
    peft_model.save_pretrained(out_dir)
    if base_model is not None:
        peft_model.unload()   # give the caller its model back without adapter layers
    return Path(out_dir)


def edit_adapter_config(adapter_dir: Union[str, Path], **changes) -> None:
    """Rewrite fields of adapter_config.json in place (None deletes a field)."""
    f = Path(adapter_dir) / "adapter_config.json"
    cfg = json.loads(f.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    f.write_text(json.dumps(cfg))


def peft_reference_model(base_dir: Union[str, Path], adapters: dict[str, Path], base_model=None):
    """A PeftModel over ``base_dir`` holding every adapter under its name."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = base_model if base_model is not None else AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32)
    items = list(adapters.items())
    pm = PeftModel.from_pretrained(base, str(items[0][1]), adapter_name=items[0][0])
    for name, path in items[1:]:
        pm.load_adapter(str(path), adapter_name=name)
    return pm.eval()


def peft_greedy(pm, adapter: Optional[str], prompt_ids: list[int], max_new_tokens: int):
    """Greedy reference of one prompt under one adapter (None: the base model)."""
    from tests.models.utils import hf_greedy

    if adapter is None:
        with pm.disable_adapter():
            return hf_greedy(pm, prompt_ids, max_new_tokens)
    pm.set_adapter(adapter)
    return hf_greedy(pm, prompt_ids, max_new_tokens)


def lora_row_bytes(model_dir: Union[str, Path]) -> int:
    """float32 bytes of one adapter rank row over q/k/v, o, gate/up and down of every layer of a Llama-shaped
    checkpoint (what ``LoRAManager.row_bytes`` counts: A's inputs and B's outputs of each slice)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    hd = c.hidden_size // c.num_attention_heads
    q, kv, h, i = c.num_attention_heads * hd, c.num_key_value_heads * hd, c.hidden_size, c.intermediate_size
    per_layer = (3 * h + q + 2 * kv) + (q + h) + (2 * h + 2 * i) + (i + h)
    return 4 * c.num_hidden_layers * per_layer
