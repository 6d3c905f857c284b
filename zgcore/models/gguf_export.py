"""A student's Hugging Face folder written as a GGUF file that llama.cpp runs, and quantized by
llama.cpp's own quantizer.

Two paths, picked from the folder's ``config.json`` (:func:`layer_plan`):

* ``llama``: every layer softmax attention with one MLP width and one key-value head count (the
  experiment's students, zero-padded narrower blocks included): llama.cpp's ``llama`` architecture,
  the tensors and keys that llama.cpp's ``convert_hf_to_gguf.py`` writes for a ``LlamaForCausalLM``.
* ``deci``: layers of their own MLP widths or key-value heads (the library's picks) or without
  attention (mixer ``none``, Puzzle's no-op): llama.cpp's ``deci`` architecture (Nemotron-51B, from
  Puzzle; Bercovich et al. 2024, arXiv:2411.19146), which reads ``feed_forward_length``,
  ``attention.head_count`` and ``attention.head_count_kv`` as per-layer arrays, a head count of 0
  marking a layer with no attention sub-layer (and no attention norm).

The whole file is written with the ``gguf`` library's ``GGUFWriter`` (a dependency of the project):
llama.cpp's converter ships only in its source tree, not in the ``gguf`` or ``llama-cpp-python``
wheels, and has no per-layer shapes for the ``llama`` architecture. Queries and keys are permuted
as the converter permutes them (llama.cpp's rotary embedding pairs neighbouring channels,
Hugging Face's the two halves). The tokenizer metadata is copied unchanged from the teacher's GGUF
when it has one, else built from the folder's byte-level BPE ``tokenizer.json``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from collections.abc import Mapping, Sequence

import numpy as np

from zgcore.checks import ConfigError

QUANTS = ("f32", "f16", "q8_0", "q4_k_m")  # --quant: written directly (f32, f16) or by llama.cpp's quantizer
QUANTIZED = {"q8_0": 7, "q4_k_m": 15}  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q8_0, LLAMA_FTYPE_MOSTLY_Q4_K_M
EXPORTED_MIXERS = ("softmax", "none")  # the token mixers llama.cpp runs (docs/export.md)
FAMILIES = ("llama",)
LLAMA_CPP = "llama-cpp-python==0.3.36"
INSTALL = (f"CMAKE_ARGS='-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF' pip install '{LLAMA_CPP}' "
           "(or install the project's test extra: pip install -e '.[test]')")


class ExportError(ConfigError):
    """A student llama.cpp cannot run, or a setting the export does not take (one line; exit 2 on the command line)."""


def refusal(where: str, mixer: str) -> str:
    """The one line naming why ``mixer`` (at ``where``) cannot be exported and the kinds that can."""
    return (f"{where}={mixer!r}: llama.cpp cannot run this token mixer, so its student has no GGUF export; the kinds "
            f"that export: {', '.join(EXPORTED_MIXERS)} (none not in the first layer), with any per-layer MLP widths "
            "and kv_heads (docs/export.md)")


def check_exportable(mixers: Mapping[str, str], model_type: str, quant: str, rope_scaling: Any = None) -> None:
    """Check a student before anything runs: its family, every block's mixer (``{where: mixer}``, in
    block order), the first block keeping attention, the rotary scaling and ``quant``.

    Raises:
        ExportError: one line naming what to change.
    """
    if quant not in QUANTS:
        raise ExportError(f"--quant {quant!r}: choose one of {', '.join(QUANTS)}")
    if model_type not in FAMILIES:
        raise ExportError(f"GGUF export covers the {', '.join(FAMILIES)} family, not {model_type!r}")
    kind = (dict(rope_scaling).get("rope_type") or "default") if rope_scaling else "default"
    if kind != "default":
        raise ExportError(f"the teacher's rotary scaling {kind!r} is not exported (plain rotary positions only)")
    for where, m in mixers.items():
        if m not in EXPORTED_MIXERS:
            raise ExportError(refusal(where, m))
    first = next(iter(mixers.items()), None)
    if first and first[1] == "none":
        raise ExportError(f"{first[0]}='none' in the first block: llama.cpp's deci architecture reads head sizes from "
                          "layer 0, which must keep attention (use mixer=none in a later block)")
    if quant in QUANTIZED:
        llama_cpp_or_raise(f"--quant {quant}")


def llama_cpp_or_raise(why: str):
    """The imported ``llama_cpp`` module. Raises :class:`ExportError` saying how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise ExportError(f"{why} needs llama.cpp's Python bindings, which are not installed: {INSTALL}") from None
    return llama_cpp


def layer_plan(config: Mapping[str, Any]) -> dict[str, Any]:
    """The GGUF shape of a student folder's ``config.json`` (a ``llama``, heterogeneous or converted
    Llama): ``{"arch": "llama" | "deci", "mixers", "widths", "heads", "kv_heads"}``, one entry per
    layer (``heads`` and ``kv_heads`` 0 for a layer without attention).

    Raises:
        ExportError: a mixer llama.cpp cannot run, no attention in layer 0, or another family.
    """
    n = int(config["num_hidden_layers"])
    mixers = list(config.get("layer_mixers") or ["softmax"] * n)
    check_exportable({f"layer {i} mixer": m for i, m in enumerate(mixers)}, "llama"
                     if config.get("model_type") in ("llama", "zg_converted_llama") else str(config.get("model_type")),
                     "f32", config.get("rope_parameters") or config.get("rope_scaling"))
    widths = [int(w) for w in (config.get("layer_intermediate_sizes") or [config["intermediate_size"]] * n)]
    kv = [int(k) for k in (config.get("layer_kv_heads") or [config.get("num_key_value_heads")
                                                             or config["num_attention_heads"]] * n)]
    heads = [0 if m == "none" else int(config["num_attention_heads"]) for m in mixers]
    kv = [0 if m == "none" else k for m, k in zip(mixers, kv)]
    uniform = len(set(widths)) == 1 and len(set(kv)) == 1 and "none" not in mixers
    return {"arch": "llama" if uniform else "deci", "mixers": mixers, "widths": widths, "heads": heads, "kv_heads": kv}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's rotary layout of a query or key projection ``[heads * d, hidden]`` (halves) as
    llama.cpp's (neighbouring pairs), as ``convert_hf_to_gguf.py`` permutes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def teacher_tokenizer_fields(gguf_file: str | os.PathLike) -> list[tuple[str, Any, Any, Any]]:
    """Every ``tokenizer.*`` key of a GGUF file as ``(key, value, type, sub_type)``, unchanged."""
    from gguf import GGUFReader, GGUFValueType

    out = []
    for key, field in GGUFReader(str(gguf_file)).fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            out.append((key, field.contents(), field.types[0], sub))
    return out


def bpe_tokenizer_fields(folder: Path, vocab_size: int) -> list[tuple[str, Any, Any, Any]]:
    """The ``tokenizer.*`` keys of a byte-level BPE ``tokenizer.json`` (tokens by id, padded to
    ``vocab_size`` with unused ``[PAD<i>]`` tokens; added special tokens as control tokens; merges).

    Raises:
        ExportError: no ``tokenizer.json`` or a tokenizer model other than BPE.
    """
    from gguf import GGUFValueType as T, TokenType

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ExportError(f"{folder}: no tokenizer.json (and the teacher is not a GGUF to take the tokenizer from)")
    tj = json.loads(path.read_text())
    if tj["model"].get("type") != "BPE":
        raise ExportError(f"{path}: a {tj['model'].get('type')} tokenizer; the export builds byte-level BPE ones only")
    vocab = dict(tj["model"]["vocab"])
    added = {a["content"]: a for a in tj.get("added_tokens", [])}
    vocab.update({c: a["id"] for c, a in added.items()})
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        t = by_id.get(i)
        tokens.append(t if t is not None else f"[PAD{i}]")
        types.append(TokenType.UNUSED if t is None else TokenType.CONTROL if added.get(t, {}).get("special")
                     else TokenType.USER_DEFINED if t in added else TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"].get("merges", [])]
    # llama.cpp needs a merges key and GGUF no empty array: with no merges (the tiny byte tokenizer) one that never
    # applies (a BPE symbol starts as one character, and no merge makes "zg-none")
    merges = merges or ["zg-none zg-none"]
    tc = folder / "tokenizer_config.json"
    cfg = json.loads(tc.read_text()) if tc.is_file() else {}
    out = [("tokenizer.ggml.model", "gpt2", T.STRING, None), ("tokenizer.ggml.pre", "default", T.STRING, None),
           ("tokenizer.ggml.tokens", tokens, T.ARRAY, T.STRING),
           ("tokenizer.ggml.token_type", [int(t) for t in types], T.ARRAY, T.INT32),
           ("tokenizer.ggml.merges", merges, T.ARRAY, T.STRING),
           ("tokenizer.ggml.add_bos_token", False, T.BOOL, None)]
    for name in ("bos", "eos", "pad", "unk"):
        tok = cfg.get(f"{name}_token")
        tok = tok.get("content") if isinstance(tok, dict) else tok
        if tok in vocab:
            out.append((f"tokenizer.ggml.{name}_token_id", int(vocab[tok]), T.UINT32, None))
    return out


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    if not out:
        raise ExportError(f"{folder}: no .safetensors weights")
    return out


def write_gguf(folder: str | os.PathLike, out: str | os.PathLike, dtype: str = "f32",
               teacher_gguf: str | os.PathLike | None = None, name: str = "zerograph-student") -> dict[str, Any]:
    """Write the student of ``folder`` (a Hugging Face Llama folder: plain, heterogeneous or converted)
    to ``out`` as GGUF, weights as float32 (``dtype`` ``"f32"``) or their matrices as float16
    (``"f16"``; norms stay float32, as the converter writes them). Tokenizer keys come from
    ``teacher_gguf`` unchanged when given. Returns :func:`layer_plan`'s plan plus ``"tensors"``.

    Raises:
        ExportError: the folder holds a student llama.cpp cannot run or a tensor the plan has no place for.
    """
    import gguf

    folder, out = Path(folder), Path(out)
    cfg = json.loads((folder / "config.json").read_text())
    plan = layer_plan(cfg)
    n, arch = int(cfg["num_hidden_layers"]), plan["arch"]
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(name)
    w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_embedding_length(hidden)
    w.add_block_count(n)
    per_layer = arch == "deci"
    w.add_feed_forward_length(plan["widths"] if per_layer else plan["widths"][0])
    w.add_head_count(plan["heads"] if per_layer else heads)
    w.add_head_count_kv(plan["kv_heads"] if per_layer else plan["kv_heads"][0])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta") or 10000.0
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(int(cfg["vocab_size"]))
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    fields = (teacher_tokenizer_fields(teacher_gguf) if teacher_gguf
              else bpe_tokenizer_fields(folder, int(cfg["vocab_size"])))
    for key, value, vtype, sub in fields:
        w.add_key_value(key, value, vtype, sub)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DECI if per_layer else gguf.MODEL_ARCH.LLAMA, n)
    tensors = _tensors(folder)
    if cfg.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    written = []
    for key in sorted(tensors, key=_order):
        t = tensors[key].astype(np.float32)
        layer = int(key.split(".")[2]) if key.startswith("model.layers.") else None
        if layer is not None and plan["mixers"][layer] == "none" and ".input_layernorm." in key:
            continue  # deci: a layer without attention has no attention norm (ZGMixer "none" never reads it)
        if key.endswith("self_attn.q_proj.weight"):
            t = permute(t, plan["heads"][layer])
        elif key.endswith("self_attn.k_proj.weight"):
            t = permute(t, plan["kv_heads"][layer])
        new = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ExportError(f"{folder}: tensor {key} has no GGUF name in llama.cpp's {arch} architecture")
        if dtype == "f16" and t.ndim == 2:
            t = t.astype(np.float16)
        w.add_tensor(new, np.ascontiguousarray(t))
        written.append(new)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {**plan, "tensors": len(written)}


def _order(key: str) -> tuple:
    parts = key.split(".")
    return (1, int(parts[2]), key) if key.startswith("model.layers.") else (0 if "embed" in key else 2, 0, key)


def quantize(src: str | os.PathLike, out: str | os.PathLike, quant: str, threads: int = 1) -> None:
    """Quantize the GGUF file ``src`` into ``out`` with llama.cpp's own quantizer
    (``llama_model_quantize``; ``quant`` one of :data:`QUANTIZED`, q4_k_m as ``llama-quantize``'s
    Q4_K_M mix). Raises :class:`ExportError` without llama.cpp, ``RuntimeError`` when it fails."""
    import ctypes

    llama_cpp = llama_cpp_or_raise(f"--quant {quant}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANTIZED[quant]
    params.nthread = int(threads)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama.cpp's quantizer failed ({rc}) on {src} -> {quant}")


def export(folder: str | os.PathLike, out: str | os.PathLike, quant: str = "f32",
           teacher_gguf: str | os.PathLike | None = None, threads: int = 1) -> dict[str, Any]:
    """The student of ``folder`` as the GGUF file ``out`` at ``quant`` (:data:`QUANTS`): written
    directly at f32 or f16, or written at f32 beside ``out`` then quantized by llama.cpp. Returns
    :func:`write_gguf`'s record plus ``"quant"`` and ``"bytes"``."""
    out = Path(out)
    if quant in QUANTIZED:
        f32 = out.with_name(out.stem + ".f32.tmp.gguf")
        try:
            rec = write_gguf(folder, f32, "f32", teacher_gguf)
            quantize(f32, out, quant, threads)
        finally:
            f32.unlink(missing_ok=True)
    else:
        rec = write_gguf(folder, out, quant, teacher_gguf)
    return {**rec, "quant": quant, "bytes": out.stat().st_size}


def mixers_of(blocks: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """``{"blocks.<i>.mixer": mixer}`` of block train settings, in block order."""
    return {f"blocks.{i}.mixer": str(b.get("mixer", "softmax")) for i, b in enumerate(blocks)}
