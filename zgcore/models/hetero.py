"""Assembly without padding: student blocks of different MLP widths and key-value head counts
stitched into one causal LM whose layers really have those shapes, so that its parameter count
and FLOPs are the blocks' own.

When every layer has one shape the student is the family's own model (a plain folder, as
:func:`zgcore.models.adapters.assemble` builds); otherwise, for the Llama family, it is
:class:`zgcore.models.hf_hetero_llama.ZGHeteroLlamaForCausalLM`, whose folder carries its modelling
code (``trust_remote_code``). Source: ZeroGraph (arXiv:2611.02200), assembly of trained blocks;
Bercovich et al. 2024, "Puzzle" (arXiv:2411.19146), heterogeneous layers.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from zgcore.models import mixers
from zgcore.models.adapters import StudentBlock, adapter_for, assemble, fill_student
from zgcore.models.families import attn_implementation
from zgcore.models.heads import kv_heads as teacher_kv_heads

HETERO_FAMILIES = ("llama",)  # families with modelling code for layers of their own shapes


def layer_shapes(blocks: Sequence[StudentBlock], config) -> tuple[list[int], list[int]]:
    """``(widths, kv_heads)``: each layer's MLP width and key-value heads, in order (teacher
    ``config`` supplies the KV count of blocks that keep the teacher's)."""
    widths = [b.width for b in blocks for _ in b.layers]
    kvs = [int(b.kv_heads or teacher_kv_heads(config)) for b in blocks for _ in b.layers]
    return widths, kvs


def is_uniform(blocks: Sequence[StudentBlock], config) -> bool:
    """Whether every layer of ``blocks`` has one MLP width and one key-value head count."""
    widths, kvs = layer_shapes(blocks, config)
    return len(set(widths)) == 1 and len(set(kvs)) == 1


def assemble_exact(teacher: nn.Module, blocks: Sequence[StudentBlock]) -> nn.Module:
    """The teacher's embedding, ``blocks`` in order and the teacher's final norm and LM head as one
    causal LM with no padded channel (the teacher is not modified; block weights are copied).

    Args:
        teacher: the teacher causal LM. blocks: student blocks in partition order, each
            ``[B, T, H]`` float32 -> same; their layers may differ in MLP width and KV heads.

    Returns:
        A float32 causal LM in eval mode with ``sum(len(b.layers))`` layers: a
        ``ZGConvertedLlamaForCausalLM`` when a block's mixer is not softmax
        (:mod:`zgcore.models.hf_converted_llama`), else the family's class when :func:`is_uniform`,
        else a ``ZGHeteroLlamaForCausalLM``.

    Raises:
        ValueError: layers of different shapes, or converted mixers, in a family that has no
            modelling code for them.
        RuntimeError: a parameter or buffer left unfilled.
    """
    from transformers import AutoModelForCausalLM

    ad = adapter_for(teacher)
    widths, kvs = layer_shapes(blocks, teacher.config)
    cfg = ad.sub_config(teacher.config, range(len(widths)), headless=False)
    layer_types = [t for b in blocks for t in (getattr(b.body.config, "layer_types", None) or [])]
    if layer_types:
        cfg.layer_types = layer_types
    layer_mixers = mixers.layer_mixers(blocks)
    if set(layer_mixers) != {mixers.DEFAULT}:
        mixers.check_family({"mixer": next(m for m in layer_mixers if m != mixers.DEFAULT)}, teacher.config.model_type)
        from zgcore.models.hf_converted_llama import ZGConvertedLlamaConfig, ZGConvertedLlamaForCausalLM

        windows = {int(b.window) for b in blocks if b.mixer in mixers.WINDOWED}
        if len(windows) > 1:
            raise ValueError(f"windowed blocks with different windows ({sorted(windows)}) cannot share one config; "
                             "give them one train.window")
        keep = {k: v for k, v in cfg.to_dict().items() if k not in ("model_type", "architectures", "transformers_version")}
        ccfg = ZGConvertedLlamaConfig(**{**keep, "layer_intermediate_sizes": widths, "layer_kv_heads": kvs,
                                         "layer_mixers": layer_mixers, "mixer_window": windows.pop() if windows else 64})
        with torch.device("meta"):
            student = ZGConvertedLlamaForCausalLM(ccfg)
        return fill_student(student, teacher, blocks).float().eval()
    if is_uniform(blocks, teacher.config):
        setattr(cfg, ad.width_key, widths[0])
        if kvs[0] != teacher_kv_heads(teacher.config):
            cfg.num_key_value_heads = kvs[0]
        with torch.device("meta"):
            student = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation(cfg), dtype=torch.float32)
    else:
        if teacher.config.model_type not in HETERO_FAMILIES:
            raise ValueError(f"layers of different MLP widths or KV heads are built for {', '.join(HETERO_FAMILIES)}, "
                             f"not {teacher.config.model_type!r}")
        from zgcore.models.hf_hetero_llama import (
            ZGHeteroLlamaConfig,
            ZGHeteroLlamaForCausalLM,
        )

        keep = {k: v for k, v in cfg.to_dict().items() if k not in ("model_type", "architectures", "transformers_version")}
        hcfg = ZGHeteroLlamaConfig(**{**keep, "layer_intermediate_sizes": widths, "layer_kv_heads": kvs})
        hcfg._attn_implementation = attn_implementation(cfg)
        with torch.device("meta"):
            student = ZGHeteroLlamaForCausalLM(hcfg)
    return fill_student(student, teacher, blocks).float().eval()


def assemble_student(teacher: nn.Module, blocks: Sequence[StudentBlock]) -> nn.Module:
    """The experiment's assembly: :func:`zgcore.models.adapters.assemble` (the family's own class,
    narrower blocks zero-padded) unless a block's mixer is not softmax, then :func:`assemble_exact`
    (a converted student, whose folder carries its modelling code)."""
    if any(b.mixer != mixers.DEFAULT for b in blocks):
        return assemble_exact(teacher, blocks)
    return assemble(teacher, blocks)


def save_student(student: nn.Module, tokenizer, folder: str | os.PathLike) -> bool:
    """Save an :func:`assemble_exact` student and its tokenizer to ``folder`` (with the modelling
    code and ``auto_map`` when heterogeneous). Returns whether it is heterogeneous."""
    from zgcore.models.hf_converted_llama import ZGConvertedLlamaForCausalLM
    from zgcore.models.hf_hetero_llama import ZGHeteroLlamaForCausalLM

    folder = Path(folder)
    student.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    for cls, codes in ((ZGHeteroLlamaForCausalLM, ["hf_hetero_llama.py"]),
                       (ZGConvertedLlamaForCausalLM, ["hf_converted_llama.py", "hf_linear_attention.py"])):
        for code in codes:  # save_pretrained copies the class's file and the files it imports relatively
            if isinstance(student, cls) and not (folder / code).is_file():
                raise RuntimeError(f"{folder}: save_pretrained did not copy the modelling code {code}")
    return isinstance(student, (ZGHeteroLlamaForCausalLM, ZGConvertedLlamaForCausalLM))
