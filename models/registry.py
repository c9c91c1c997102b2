"""Maps a checkpoint's ``architectures`` entry to the class that serves it."""

from __future__ import annotations

from typing import Any

from torch import nn

from tandem.models.deepseek_v3 import DeepseekV3ForCausalLM
from tandem.models.glm4_moe import Glm4MoeForCausalLM
from tandem.models.gpt_oss import GptOssForCausalLM
from tandem.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from tandem.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}


def resolve_model_class(config: Any) -> type[nn.Module]:
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported model architecture {archs or '(none in config.json)'}; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )
