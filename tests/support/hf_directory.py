"""The default model's weights as an HF model directory (bfloat16 safetensors, config,
tokenizer), optionally with another chat template: for servers that need a model as users
download them, or a template the GGUF does not carry."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from radixserve.model.loader import load_model_files


def save_hf_directory(model_path: Path, directory: Path, chat_template: str | None = None
                      ) -> Path:
    """Writes `model_path`'s model into `directory` (its own template unless `chat_template`)."""
    files = load_model_files(model_path, progress=False)
    cfg = files.config
    save_file({name: w.to(torch.bfloat16) for name, w in files.weights.items()},
              str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": True}))
    files.tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": chat_template or files.tokenizer.chat_template,
        "eos_token": files.tokenizer.eos_token, "bos_token": files.tokenizer.bos_token}))
    return directory
