"""What a student block costs at inference, from its shape alone (no weights are read): its
non-embedding parameters, its FLOPs per token at a sequence length, and its KV-cache bytes per token.

The block is built on PyTorch's ``meta`` device with the family's own Hugging Face layer code
(:class:`zgcore.models.adapters.StudentBlock`), so the parameter count is exact for every family
(biases, per-head norms) without being written out per family.

* parameters: every parameter of the block's decoder layers;
* FLOPs/token: ``2 x`` the weights of every ``nn.Linear`` (one multiply-add each) plus attention's
  scores and weighted sum, ``2 x 2 x heads x head_dim x (T + 1) / 2`` per layer (a causal token
  at position ``t`` attends to ``t + 1`` keys; the mean over ``T`` positions is ``(T + 1) / 2``);
* KV bytes/token: ``2 (keys and values) x kv_heads x head_dim x 2 bytes`` (a 16-bit cache) per layer.
* token mixers other than softmax (:mod:`zgcore.models.mixers`): a ``window`` layer attends to
  ``min(t + 1, window)`` keys and caches ``window`` of them; a ``linear`` layer costs
  ``4 x heads x 2 head_dim x head_dim`` FLOPs/token (state update and read) and caches
  ``heads x (2d x d + 2d)`` numbers; ``linear_window`` both; ``none`` nothing. Given a decode length
  ``context`` (``library.context`` > 0), ``kv_bytes`` is the decode state's bytes per sequence at that
  length (softmax grows with it, the others stop); without one, bytes per token as above (a
  converted layer: its state at ``seq_len`` tokens divided by ``seq_len``).

A whole student adds the same constants to every choice (:func:`student_extra`): the final norm's
parameters, and the LM head's ``2 x hidden x vocab`` FLOPs per token. Follows Kaplan et al. 2020,
"Scaling Laws for Neural Language Models" (arXiv:2001.08361), section 2.1 (non-embedding
parameters; forward FLOPs of 2N plus the attention context term).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from zgcore.models.heads import head_dim
from zgcore.models.heads import kv_heads as teacher_kv_heads

KV_CACHE_BYTES = 2  # bytes per cached key or value element (bfloat16 / float16 inference)
UNITS = ("params", "flops", "kv_bytes")


def block_cost(config, layer_indices: Sequence[int], intermediate_size: int | None, kv_heads: int | None,
               seq_len: int, mixer: str = "softmax", window: int | None = None, context: int = 0) -> dict[str, float]:
    """``{"params", "flops", "kv_bytes"}`` of one student block (see the module docstring).

    Args:
        config: the teacher's HF config. layer_indices: the teacher layers it keeps (their count
            is the block's depth; per-layer config such as ``layer_types`` follows them).
        intermediate_size: MLP width (None: the teacher's). kv_heads: key-value heads (None: the
            teacher's). seq_len: the sequence length FLOPs are counted at (tokens).
        mixer, window: the layers' token mixer. context: the decode length (tokens) at which
            ``kv_bytes`` counts the decode state of one sequence (0: bytes per token).

    Returns:
        Parameters (int), FLOPs per token (float) and KV-cache bytes (int), as floats/ints.
    """
    from zgcore.models.adapters import StudentBlock

    with torch.device("meta"):
        block = StudentBlock(config, list(layer_indices), intermediate_size, kv_heads, mixer, window)
    layers = block.layers
    params = sum(p.numel() for p in layers.parameters())
    linear = sum(m.weight.numel() for m in layers.modules() if isinstance(m, nn.Linear))
    linear += sum(m.weight.numel() for m in layers.modules() if type(m).__name__ == "Conv1D")  # GPT-2
    n, heads, d = len(layer_indices), int(config.num_attention_heads), head_dim(config)
    kv = int(kv_heads) if kv_heads is not None else teacher_kv_heads(config)
    T, w = int(seq_len), int(window or 0)
    # keys a token attends to with softmax, mean over the T positions
    keys = (T + 1) / 2 if mixer == "softmax" else sum(min(t + 1, w) for t in range(T)) / T if w else 0.0
    lin = 4.0 * heads * 2 * d * d if mixer in ("linear", "linear_window") else 0.0
    flops = 2.0 * linear + n * (4.0 * heads * d * keys + lin)

    def state(tokens: int) -> int:  # one layer's decode state after ``tokens`` tokens, elements
        ring = {"softmax": tokens, "window": min(tokens, w), "linear_window": min(tokens, w)}.get(mixer, 0)
        return 2 * kv * d * ring + (heads * (2 * d * d + 2 * d) if mixer in ("linear", "linear_window") else 0)

    if context:
        kv_bytes = n * state(int(context)) * KV_CACHE_BYTES
    elif mixer == "softmax":
        kv_bytes = n * 2 * kv * d * KV_CACHE_BYTES
    else:
        kv_bytes = round(n * state(T) * KV_CACHE_BYTES / T)
    return {"params": int(params), "flops": float(flops), "kv_bytes": int(kv_bytes)}


def student_extra(config) -> dict[str, float]:
    """What every student adds to its blocks' summed cost: the final norm's parameters and the LM
    head's FLOPs per token (``2 x hidden x vocab``); no KV bytes."""
    from transformers import AutoModelForCausalLM

    from zgcore.models.adapters import adapter_for
    from zgcore.models.families import attn_implementation

    ad = adapter_for(config)
    cfg = ad.sub_config(config, [], headless=False)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation(cfg), dtype=torch.float32)
    norm = getattr(ad.base_model(lm), ad.norm)
    return {"params": int(sum(p.numel() for p in norm.parameters())),
            "flops": 2.0 * int(config.hidden_size) * int(config.vocab_size), "kv_bytes": 0}


def non_embedding_params(model: nn.Module) -> int:
    """Parameters of a causal LM other than its token embedding, its positional embedding (GPT-2's
    ``wpe``) and its LM head (counted once when tied)."""
    mods = (model.get_input_embeddings(), model.get_output_embeddings(), getattr(getattr(model, "transformer", None), "wpe", None))
    skip = {id(p) for m in mods if m is not None for p in m.parameters()}
    return int(sum(p.numel() for p in model.parameters() if id(p) not in skip))


SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                     num_hidden_layers=30, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
                     rms_norm_eps=1e-5)


def teacher_config(spec: str, outputs: str = "outputs"):
    """The teacher's HF config without its weights, for costing students before anything runs:
    the built-in ``smollm2-135m``'s shape (:data:`SMOLLM2_SHAPE`), a tiny family's, or a local
    folder's / Hub id's ``config.json``. Raises :class:`~zgcore.checks.ConfigError` as
    :func:`zgcore.models.teacher.describe` does."""
    import transformers

    from zgcore.models import teacher as zteacher

    if spec == "smollm2-135m":
        return transformers.LlamaConfig(**SMOLLM2_SHAPE)
    if spec in zteacher.TINY_FAMILIES:
        return zteacher.tiny_config(zteacher.TINY_FAMILIES[spec])
    zteacher.describe(spec, outputs)
    return zteacher._load_config(spec)
