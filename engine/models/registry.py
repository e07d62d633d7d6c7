"""``architectures`` name in config.json -> our model class."""

from __future__ import annotations

import torch.nn as nn

from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.gemma3_vl import Gemma3ForConditionalGeneration
from engine.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from engine.models.llava import LlavaForConditionalGeneration
from engine.models.mixtral import MixtralForCausalLM
from engine.models.qwen2_audio import Qwen2AudioForConditionalGeneration
from engine.models.qwen2_moe import Qwen2MoeForCausalLM
from engine.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM
from engine.models.whisper import WhisperForConditionalGeneration

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "WhisperForConditionalGeneration": WhisperForConditionalGeneration,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Qwen2AudioForConditionalGeneration": Qwen2AudioForConditionalGeneration,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(config) -> type[nn.Module]:
    archs = list(getattr(config, "architectures", None) or [])
    if not archs:
        # Configs built in code may lack `architectures`; fall back on model_type.
        archs = {"llama": ["LlamaForCausalLM"], "qwen2": ["Qwen2ForCausalLM"],
                 "mistral": ["MistralForCausalLM"], "llava": ["LlavaForConditionalGeneration"],
                 "qwen3": ["Qwen3ForCausalLM"],
                 "qwen2_vl": ["Qwen2VLForConditionalGeneration"],
                 "qwen2_5_vl": ["Qwen2_5_VLForConditionalGeneration"],
                 "mixtral": ["MixtralForCausalLM"], "qwen3_moe": ["Qwen3MoeForCausalLM"],
                 "qwen2_moe": ["Qwen2MoeForCausalLM"],
                 "gemma3_text": ["Gemma3ForCausalLM"], "gemma3": ["Gemma3ForConditionalGeneration"],
                 "whisper": ["WhisperForConditionalGeneration"],
                 "qwen2_audio": ["Qwen2AudioForConditionalGeneration"]}.get(getattr(config, "model_type", ""), [])
    for arch in archs:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(f"Model architectures {archs or '[unknown]'} are not supported by Chorus. "
                     f"Supported architectures: {', '.join(supported_architectures())}.")
