"""A Llama whose decoder layers have their own MLP widths and key-value head counts: the modelling
code that a heterogeneous student's folder carries (``trust_remote_code``), because Hugging Face's
``LlamaConfig`` has one ``intermediate_size`` and one ``num_key_value_heads`` for every layer.

This file is copied into the student's folder by ``save_pretrained`` (``auto_map`` in its
``config.json``) and must import nothing but ``torch`` and ``transformers``: the folder loads alone
with ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``. Its ``config.json``
says ``model_type`` ``"llama"``, so that ``AutoConfig`` and therefore ``AutoTokenizer`` read the
folder without remote code (no y/N question, no "model of type" warning); the model itself needs
``trust_remote_code=True`` (without it transformers builds a plain Llama and stops on the size
mismatch of the narrower layers).

Each layer is transformers' own ``LlamaDecoderLayer``, built from a copy of the config with that
layer's ``intermediate_size`` and ``num_key_value_heads``; embedding, rotary embedding, masks, final
norm, LM head, cache and generation are ``LlamaForCausalLM``'s. Heterogeneous layers as in
Bercovich et al. 2024, "Puzzle" (arXiv:2411.19146), whose DeciLM folders do the same.
"""
from __future__ import annotations

import copy

from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


class ZGHeteroLlamaConfig(LlamaConfig):
    """``LlamaConfig`` plus per-layer lists.

    Attributes:
        layer_intermediate_sizes: MLP width of each decoder layer (``num_hidden_layers`` ints;
            None: ``intermediate_size`` everywhere).
        layer_kv_heads: key-value heads of each layer (None: ``num_key_value_heads`` everywhere);
            each divides ``num_attention_heads``.
    """

    model_type = "llama"  # what AutoConfig (so AutoTokenizer) reads without remote code; auto_map adds the rest
    layer_intermediate_sizes: list[int] | None = None
    layer_kv_heads: list[int] | None = None

    def layer_config(self, i: int) -> LlamaConfig:
        """A copy of this config with layer ``i``'s MLP width and key-value heads."""
        cfg = copy.copy(self)
        if self.layer_intermediate_sizes is not None:
            cfg.intermediate_size = int(self.layer_intermediate_sizes[i])
        if self.layer_kv_heads is not None:
            cfg.num_key_value_heads = int(self.layer_kv_heads[i])
        return cfg


class ZGHeteroLlamaForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` whose layer ``i`` has ``config.layer_config(i)``'s shape. Forward,
    generation and the cache are the parent's; input ``[batch, seq]`` int64 ids, logits
    ``[batch, seq, vocab]``."""

    config_class = ZGHeteroLlamaConfig

    def __init__(self, config: ZGHeteroLlamaConfig):
        super().__init__(config)
        for i in range(config.num_hidden_layers):
            layer = LlamaDecoderLayer(config.layer_config(i), i)
            for mod in (layer.self_attn, layer.mlp):  # the shared config: attention implementation set at load
                if hasattr(mod, "config"):
                    mod.config = config
            self.model.layers[i] = layer
        self.post_init()


ZGHeteroLlamaConfig.register_for_auto_class()
ZGHeteroLlamaForCausalLM.register_for_auto_class("AutoModelForCausalLM")
