"""The ``config.json`` values of the real teachers the plan is checked and projected at (no weights:
``bench/scale_rehearsal.py`` builds random-weight teachers from them, ``zerograph plan`` reads them
from a folder holding only ``config.json``). Values as published in each model's Hugging Face repository
(meta-llama/Llama-3.2-1B, meta-llama/Llama-3.1-8B, meta-llama/Llama-3.1-70B, Qwen/Qwen2.5-1.5B,
Qwen/Qwen2.5-3B), written here because the Hub is out of reach from the test machines.
"""

from __future__ import annotations

import json
from pathlib import Path

_LLAMA3_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}


def _llama(hidden: int, inter: int, layers: int, heads: int, tie: bool, rope: dict) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "max_position_embeddings": 131072,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": 8,
        "head_dim": hidden // heads,
        "rms_norm_eps": 1e-05,
        "rope_scaling": rope,
        "rope_theta": 500000.0,
        "tie_word_embeddings": tie,
        "torch_dtype": "bfloat16",
        "vocab_size": 128256,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
    }


def _qwen25(hidden: int, inter: int, layers: int, heads: int) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "max_position_embeddings": 32768,
        "max_window_layers": layers,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_sliding_window": False,
        "vocab_size": 151936,
        "initializer_range": 0.02,
    }


CONFIGS = {
    "Llama-3.2-1B": _llama(2048, 8192, 16, 32, True, {**_LLAMA3_ROPE, "factor": 32.0}),
    "Llama-3.1-8B": _llama(4096, 14336, 32, 32, False, _LLAMA3_ROPE),
    "Llama-3.1-70B": _llama(8192, 28672, 80, 64, False, _LLAMA3_ROPE),
    "Qwen2.5-1.5B": _qwen25(1536, 8960, 28, 12),
    "Qwen2.5-3B": _qwen25(2048, 11008, 36, 16),
}


def write_config(name: str, folder: str | Path) -> Path:
    """Write ``CONFIGS[name]`` as ``folder/config.json`` (creating the folder); returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIGS[name], indent=1))
    return folder
