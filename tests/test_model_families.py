"""Other Llama-family architectures load from HF directories and match HF's logits.

Small random-weight models built with transformers' own config classes and saved as HF
directories (config.json, model.safetensors, tokenizer.json): Llama 3 with llama3 rope
scaling, Qwen2 with q/k/v biases, Mistral with a sliding window shorter than the prompt.
"""

from __future__ import annotations

import json

import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.model.families import FAMILIES
from tests.support.families import save_checkpoint

pytestmark = [pytest.mark.model]

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512)


def _llama3():
    cfg = transformers.LlamaConfig(**SMALL, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


def _qwen2():
    cfg = transformers.Qwen2Config(**SMALL, rope_theta=1000000.0, tie_word_embeddings=True)
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # random init leaves biases at zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def _mistral():
    cfg = transformers.MistralConfig(**SMALL, sliding_window=24, tie_word_embeddings=False)
    return transformers.MistralForCausalLM(cfg)


@pytest.mark.parametrize("build", [_llama3, _qwen2, _mistral], ids=["llama3", "qwen2", "mistral"])
def test_family_matches_hf_logits(build, tmp_path, model_path):
    torch.manual_seed(0)
    hf = build().float().eval()
    directory = save_checkpoint(hf, tmp_path / "model", model_path)
    llm = LLM(str(directory), dtype="float32", kv_cache_tokens=2048, show_progress=False)
    assert llm.engine.model_config.architecture == hf.config.model_type
    generator = torch.Generator().manual_seed(1)
    for length in (7, 40, 100):  # 40 and 100 exceed Mistral's window of 24
        ids = torch.randint(200, 40000, (length,), generator=generator).tolist()
        with torch.inference_mode():
            expected = hf(torch.tensor([ids])).logits[0, -1]
        got = llm.engine.prompt_logits(ids)
        assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (
            f"{length} tokens: max diff {(got - expected).abs().max():.2e}"
        )
    # Decoding through the paged path (with chunked prefill) agrees with HF's greedy search.
    ids = torch.randint(200, 40000, (50,), generator=generator).tolist()
    ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, 50, dtype=torch.long),
                      max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 50:].tolist()
    llm.engine.config.max_num_batched_tokens = 16
    ours = llm.generate({"prompt_token_ids": ids},
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert ours.outputs[0].token_ids == ref


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "hidden_size": 8,
        "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 10,
        "intermediate_size": 16}))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'; supported: ") as err:
        LLM(str(tmp_path), show_progress=False)
    for family in FAMILIES:
        for model_type in family.hf_model_types:
            assert model_type in str(err.value)
