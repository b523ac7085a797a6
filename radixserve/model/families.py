"""The registry of model families: adding one is its module (radixserve/model/<family>.py)
and one line here. The loader finds a checkpoint's family by its HF model_type or GGUF
general.architecture.
"""

from __future__ import annotations

from radixserve.model import gemma3, gpt_oss, llama, phi3, qwen3, qwen3_moe, smollm3
from radixserve.model.family import ModelFamily

FAMILIES: tuple[ModelFamily, ...] = (
    llama.FAMILY,
    qwen3.FAMILY,
    phi3.FAMILY,
    smollm3.FAMILY,
    gemma3.FAMILY,
    qwen3_moe.FAMILY,
    gpt_oss.FAMILY,
)


def hf_family(model_type: str) -> ModelFamily:
    """The family of an HF config.json's model_type (a clear error naming those we run)."""
    for family in FAMILIES:
        if model_type in family.hf_model_types:
            return family
    names = [t for f in FAMILIES for t in f.hf_model_types]
    raise ValueError(f"unsupported architecture {model_type!r}; supported: {', '.join(names)}")


def gguf_family(architecture: str) -> ModelFamily:
    """The family of a GGUF file's general.architecture."""
    for family in FAMILIES:
        if architecture in family.gguf_architectures:
            return family
    names = [a for f in FAMILIES for a in f.gguf_architectures]
    raise ValueError(f"GGUF architecture {architecture!r} is not supported (supported: "
                     f"{', '.join(names)})")


def family_named(name: str) -> ModelFamily:
    """The family a `ModelConfig.family` names."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"no model family named {name!r}")
