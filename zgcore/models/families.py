"""Decoder families: where each family keeps its decoder layers, final norm and LM head, and the
family quirks that the residual-stream view must respect.

Every Hugging Face causal LM whose decoder is a list of layers between an embedding and a final
norm + LM head fits one :class:`FamilyAdapter`. Quirks live here, driven by the model's config:

* scaled embeddings (Gemma 2/3: ``embed_tokens`` multiplies by sqrt(hidden) inside the embedding
  module, so the stream layer 0 receives — boundary 0 — is already scaled; Granite multiplies
  ``inputs_embeds`` by ``embedding_multiplier`` in the base model's forward, so a student block,
  which is fed ``inputs_embeds``, gets that multiplier set to 1);
* the whole head (:meth:`FamilyAdapter.finish_logits`): Gemma's ``final_logit_softcapping`` and
  Granite's ``logits_scaling`` are applied after the LM head, in the causal LM's forward;
* per-layer lists (``layer_types``: sliding-window vs full attention) follow the kept layers;
* attention: families whose attention SDPA cannot express (Gemma 2's attention soft-capping) run
  with the eager implementation.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from collections.abc import Sequence

if TYPE_CHECKING:  # torch loads where a model runs, not where a configuration is checked
    import torch
    from torch import nn

from zgcore.checks import ConfigError


@dataclass(frozen=True)
class FamilyAdapter:
    """Names of a family's parts inside ``AutoModelForCausalLM`` / ``AutoModel``.

    Attributes:
        base: attribute of the causal LM holding the base model (``model`` / ``transformer``).
        layers: attribute of the base model holding the decoder ``ModuleList``.
        norm: attribute of the base model holding the final norm.
        block_neutral: config keys set to a neutral value in a student block's config, because the
            base model's forward applies them to ``inputs_embeds`` (already part of boundary 0).
        mlp: ``(attribute of the layer, up-type projections, down projection, fused, conv1d)``:
            the projections whose output channels (``up``) / input channels (``down``) are the
            MLP's intermediate channels; ``fused`` = the one up projection holds gate and up
            stacked (Phi-3); ``conv1d`` = weights stored ``[in, out]`` (GPT-2's Conv1D).
        width_key: config key of the MLP's intermediate size.
    """

    base: str = "model"
    layers: str = "layers"
    norm: str = "norm"
    block_neutral: dict = field(default_factory=dict)
    mlp: tuple = ("mlp", ("gate_proj", "up_proj"), "down_proj", False, False)
    width_key: str = "intermediate_size"

    def base_model(self, lm: nn.Module) -> nn.Module:
        """The base (headless) model of a causal LM (a base model is its own)."""
        return getattr(lm, self.base, lm)

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        """The decoder layers of a causal LM or a base model."""
        base = getattr(model, self.base, model)
        return getattr(base, self.layers)

    def layer_prefix(self) -> str:
        """State-dict prefix of decoder layer weights in the causal LM (e.g. ``model.layers.``)."""
        return f"{self.base}.{self.layers}."

    def sub_config(self, config, layer_indices: Sequence[int], headless: bool):
        """A copy of the teacher ``config`` for a stack of the given teacher layers.

        Per-layer lists (``layer_types``) keep the entries of ``layer_indices``. ``headless``
        shrinks the vocabulary to one token (a block needs no embedding), neutralises
        :attr:`block_neutral` keys and turns every dropout off.
        """
        cfg = copy.deepcopy(config)
        cfg.num_hidden_layers = len(layer_indices)  # GPT-2 maps it to n_layer
        if getattr(cfg, "layer_types", None) is not None:
            cfg.layer_types = [config.layer_types[i] for i in layer_indices]
        if headless:
            cfg.vocab_size = 1
            cfg.pad_token_id = None
            cfg.tie_word_embeddings = False
            for k, v in self.block_neutral.items():
                setattr(cfg, k, v)
            for k in ("attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout"):
                if hasattr(cfg, k):
                    setattr(cfg, k, 0.0)
        if getattr(cfg, "quantization_config", None) is not None:
            del cfg.quantization_config
        return cfg

    @staticmethod
    def finish_logits(config, logits: torch.Tensor) -> torch.Tensor:
        """What the causal LM's forward does to the LM head's output: Granite's division by
        ``logits_scaling``, then Gemma's ``tanh`` soft-capping at ``final_logit_softcapping``."""
        scaling = getattr(config, "logits_scaling", None)
        if scaling not in (None, 1, 1.0):
            logits = logits / scaling
        cap = getattr(config, "final_logit_softcapping", None)
        if cap is not None:
            logits = (logits / cap).tanh() * cap
        return logits


_LLAMA_LIKE = FamilyAdapter()

ADAPTERS: dict[str, FamilyAdapter] = {
    "llama": _LLAMA_LIKE,  # incl. Llama 3.x rope scaling, SmolLM2, TinyLlama
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gemma2": _LLAMA_LIKE,
    "gemma3_text": _LLAMA_LIKE,
    "phi3": FamilyAdapter(mlp=("mlp", ("gate_up_proj",), "down_proj", True, False)),
    "olmo2": _LLAMA_LIKE,
    "granite": FamilyAdapter(block_neutral={"embedding_multiplier": 1.0}),
    "gpt2": FamilyAdapter("transformer", "h", "ln_f", mlp=("mlp", ("c_fc",), "c_proj", False, True),
                          width_key="n_inner"),
}


# students assembled into modelling code of their own (zgcore.models.hf_hetero_llama, hf_converted_llama):
# their parts sit where their family's do; never teachers
ASSEMBLED = {"zg_hetero_llama": "llama", "zg_converted_llama": "llama"}


def adapter_for(model_or_config) -> FamilyAdapter:
    """The adapter of a model or config (also of an assembled student's own classes,
    :data:`ASSEMBLED`). Raises :class:`ConfigError` for unsupported families."""
    cfg = getattr(model_or_config, "config", model_or_config)
    try:
        return ADAPTERS[ASSEMBLED.get(cfg.model_type, cfg.model_type)]
    except KeyError:
        raise ConfigError(f"unsupported architecture {cfg.model_type!r}; supported: {', '.join(ADAPTERS)}") from None


def attn_implementation(config) -> str:
    """``"sdpa"`` where the family's model class supports it, else ``"eager"`` (Gemma 2)."""
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", False) else "eager"
