"""Greedy local learning for LM pretraining: K gradient-isolated blocks, auxiliary heads, MTP.

Source: "Greedy Local Learning for Language Model Pretraining: Gaps and Objective Design"
(arXiv 2610.04867). A decoder-only Llama-style LM is trained from scratch, split into ``K`` blocks
of consecutive layers. Block ``j`` (0-based) owns layers ``[b_j, b_{j+1})``; block 0 also owns
the token embedding, the last block also owns the final norm and LM head. Each block reads the
previous block's output *detached* (no gradient crosses a boundary; communication between blocks
is forward-only) and steps its own AdamW optimizer. Every non-final block trains through a local
auxiliary head at its output boundary:

* ``mlp`` — a residual SwiGLU MLP, then RMSNorm and an LM head;
* ``transformer`` — one Llama decoder layer, then RMSNorm and an LM head.

The last block trains through the model's own final norm and LM head. An optional multi-token
prediction (MTP) objective at chosen boundaries adds, for offsets ``k = 2..n``, a small residual
MLP on the aux head's trunk that predicts token ``t + k`` through the same aux LM head; its mean CE
is added with weight ``mtp_weight`` (0.3 as DeepSeek-V3's MTP lambda). ``K = 1`` is ordinary
end-to-end backprop, bit for bit.

Boundaries are numbered ``1..K``: boundary ``i`` is the output of block ``i - 1``; boundaries
``1..K-1`` carry aux heads (and may carry MTP), boundary ``K`` is the model's output.

Two execution modes compute the same update: ``together`` (every block's forward on the batch,
one backward over the sum of the block losses, then every optimizer steps) and ``per_block``
(block by block: forward, backward, step, keep only the detached boundary activation). Their peak
activation memory is measured, not computed: see :class:`SavedTensorMeter`.

The library never imports Luigi. Configuration lives here (``LOCAL_DEFAULTS``); a bad value raises
:class:`zgcore.config.ConfigError` before any expensive work.
"""
from __future__ import annotations

import copy
import csv
import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import ConfigError, DEFAULTS as _MAIN_DEFAULTS, corpus_files, deep_merge, load_file, parse_overrides
from .train import block_seed, data_order, lr_at

AUX_HEADS = ("mlp", "transformer")
EXECUTIONS = ("together", "per_block")
VOCABS = ("compact", "full")
MTP_CHOICES = ("off", "first", "all")

LOCAL_DEFAULTS: dict[str, Any] = {
    "name": "local-default",
    # Only the tokenizer of this teacher spec is used (PrepareTeacher + PrepareCorpus); no teacher weights.
    "tokenizer": "smollm2-135m",
    "device": "cpu",
    "corpus": {**_MAIN_DEFAULTS["corpus"], "seq_len": 128},
    "model": {
        "n_layers": 8,
        "hidden_size": 128,
        "intermediate_size": 384,
        "n_heads": 4,
        "n_kv_heads": 2,
        "rope_theta": 10000.0,
        # "compact": the model's vocabulary is the token ids present in the token store (train and val),
        # renumbered in sorted order; "full": the tokenizer's whole vocabulary.
        "vocab": "compact",
    },
    "train": {
        "token_budget": 163840,  # tokens seen by every configuration (floored to whole batches)
        "batch_size": 8,
        "lr": 3e-3,
        "warmup_steps": 10,
        "weight_decay": 0.0,
        "grad_clip": 1.0,
        "seed": 0,  # model and aux-head initialisation
        "data_seed": 0,  # batch order; shared by every configuration of a study
        "execution": "together",
        "log_every": 10,
    },
    "local": {
        "K": 1,
        "aux": "mlp",
        "mtp_boundaries": [],  # boundaries 1..K-1 that add the MTP objective
        "mtp_n": 2,  # predict the next n tokens (offsets 1..n) at an MTP boundary
        "mtp_weight": 0.3,
    },
    "study": {"K": [1, 2, 4], "aux": ["mlp", "transformer"], "mtp": ["off", "first", "all"]},
    "eval": {"batch_size": 16, "max_sequences": 0},
}
UNHASHED_TOP = {"name", "device"}


# ----------------------------------------------------------------------------- configuration

def _check_keys(section: str, got: Mapping[str, Any], allowed: Mapping[str, Any]) -> None:
    unknown = sorted(set(got) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown key(s) in {section}: {', '.join(unknown)}; known: {', '.join(sorted(allowed))}")


def _int(where: str, v: Any, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v or v < lo:
        raise ConfigError(f"{where} must be an integer >= {lo}, got {v!r}")
    return int(v)


def _num(where: str, v: Any, positive: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ConfigError(f"{where} must be a {'positive' if positive else 'non-negative'} number, got {v!r}")
    return float(v)


def validate_model(m: Mapping[str, Any]) -> None:
    """Check the ``model`` section. Raises :class:`ConfigError`."""
    _check_keys("model", m, LOCAL_DEFAULTS["model"])
    for k in ("n_layers", "hidden_size", "intermediate_size", "n_heads", "n_kv_heads"):
        _int(f"model.{k}", m[k])
    if m["hidden_size"] % m["n_heads"]:
        raise ConfigError(f"model.hidden_size={m['hidden_size']} must be divisible by model.n_heads={m['n_heads']}")
    if m["n_heads"] % m["n_kv_heads"]:
        raise ConfigError(f"model.n_heads={m['n_heads']} must be divisible by model.n_kv_heads={m['n_kv_heads']}")
    if (m["hidden_size"] // m["n_heads"]) % 2:
        raise ConfigError("model.hidden_size / model.n_heads must be even (rotary embeddings rotate pairs)")
    _num("model.rope_theta", m["rope_theta"], positive=True)
    if m["vocab"] not in VOCABS:
        raise ConfigError(f"model.vocab must be one of {VOCABS}, got {m['vocab']!r}")


def validate_local(loc: Mapping[str, Any], n_layers: int) -> None:
    """Check one configuration's ``local`` section against a model of ``n_layers`` layers.

    Raises:
        ConfigError: ``K`` above the layer count, an unknown aux head, an MTP boundary that does
            not exist (valid: ``1..K-1``), or ``mtp_n < 2`` where MTP is on.
    """
    _check_keys("local", loc, LOCAL_DEFAULTS["local"])
    k = _int("local.K", loc["K"])
    if k > n_layers:
        raise ConfigError(f"local.K={k} exceeds the model's {n_layers} layers (model.n_layers): each block needs at least one layer")
    if k > 1 and loc["aux"] not in AUX_HEADS:
        raise ConfigError(f"unknown aux head local.aux={loc['aux']!r}; known: {', '.join(AUX_HEADS)}")
    bs = loc["mtp_boundaries"]
    if not isinstance(bs, (list, tuple)) or not all(isinstance(b, int) and not isinstance(b, bool) for b in bs):
        raise ConfigError(f"local.mtp_boundaries must be a list of boundary numbers, got {bs!r}")
    for b in bs:
        if not 1 <= b <= k - 1:
            where = "there are none (K=1 has no boundary between blocks)" if k == 1 else f"they are 1..{k - 1}"
            raise ConfigError(f"MTP at boundary {b} does not exist: with K={k} the boundaries that carry an aux head "
                              f"are numbered from 1 (output of block 0) and {where}")
    if len(set(bs)) != len(bs):
        raise ConfigError(f"local.mtp_boundaries repeats a boundary: {list(bs)}")
    if bs and _int("local.mtp_n", loc["mtp_n"]) < 2:
        raise ConfigError(f"local.mtp_n must be >= 2 (next n tokens) where MTP is on, got {loc['mtp_n']!r}")
    _num("local.mtp_weight", loc["mtp_weight"])


def validate_train(t: Mapping[str, Any], seq_len: int) -> None:
    """Check the ``train`` section. Raises :class:`ConfigError`."""
    _check_keys("train", t, LOCAL_DEFAULTS["train"])
    b = _int("train.batch_size", t["batch_size"])
    budget = _int("train.token_budget", t["token_budget"])
    if budget < b * seq_len:
        raise ConfigError(f"train.token_budget={budget} is below one batch ({b} x {seq_len} = {b * seq_len} tokens)")
    _num("train.lr", t["lr"], positive=True)
    _num("train.weight_decay", t["weight_decay"])
    _num("train.grad_clip", t["grad_clip"])
    for k in ("warmup_steps", "seed", "data_seed"):
        _int(f"train.{k}", t[k], lo=0)
    _int("train.log_every", t["log_every"])
    if t["execution"] not in EXECUTIONS:
        raise ConfigError(f"train.execution must be one of {EXECUTIONS}, got {t['execution']!r}")


def normalise_run(run: Mapping[str, Any]) -> dict[str, Any]:
    """Canonical form of one configuration ``{"model", "train", "local"}``: K=1 has no aux head
    or MTP (``aux="none"``, ``mtp_boundaries=[]``), MTP boundaries sorted, settings that cannot
    matter dropped from ``local``, so equal computations hash alike."""
    run = copy.deepcopy(dict(run))
    loc = run["local"]
    if int(loc["K"]) == 1:
        loc.update(aux="none", mtp_boundaries=[])
    loc["K"] = int(loc["K"])
    loc["mtp_boundaries"] = sorted(int(b) for b in loc["mtp_boundaries"])
    if not loc["mtp_boundaries"]:
        loc.update(mtp_n=1, mtp_weight=0.0)
    run["train"] = {k: v for k, v in run["train"].items() if k != "log_every"}
    return run


def mtp_boundaries_for(choice: Any, k: int) -> list[int]:
    """Expand a study's MTP choice for ``K=k``: ``"off"`` → [], ``"first"`` → [1], ``"all"`` →
    [1..k-1], or an explicit list of boundaries (checked later). Raises :class:`ConfigError`."""
    if isinstance(choice, (list, tuple)):
        return [int(b) for b in choice]
    if choice is False or choice == "off":  # YAML 1.1 reads a bare `off` in an override as False
        return []
    if choice == "first":
        return [1] if k > 1 else []
    if choice == "all":
        return list(range(1, k))
    raise ConfigError(f"study.mtp entries must be one of {MTP_CHOICES} or a list of boundaries, got {choice!r}")


def resolve_local(file: str | os.PathLike | None = None, overrides: str | Mapping | None = None,
                  base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Build a full local-learning study config: ``LOCAL_DEFAULTS`` < ``base`` (a preset) < file <
    overrides (``"local.K=2 model.n_layers=4"``), then validate everything, including every
    configuration the study expands to.

    Raises:
        ConfigError: any unknown key or bad value, with what to fix.
    """
    cfg = deep_merge(LOCAL_DEFAULTS, base or {})
    if file:
        cfg = deep_merge(cfg, load_file(file))
    if overrides:
        cfg = deep_merge(cfg, parse_overrides(overrides) if isinstance(overrides, str) else overrides)
    _check_keys("local-learning study", cfg, LOCAL_DEFAULTS)
    for sec in ("corpus", "model", "train", "local", "study", "eval"):
        if not isinstance(cfg[sec], Mapping):
            raise ConfigError(f"`{sec}` must be a mapping")
    _check_keys("corpus", cfg["corpus"], LOCAL_DEFAULTS["corpus"])
    c = cfg["corpus"]
    seq_len = _int("corpus.seq_len", c["seq_len"], lo=2)
    if not 0 < float(c["val_fraction"]) < 1:
        raise ConfigError(f"corpus.val_fraction must be in (0, 1), got {c['val_fraction']!r}")
    _int("corpus.max_tokens", c["max_tokens"], lo=0)
    corpus_files(c)
    validate_model(cfg["model"])
    validate_train(cfg["train"], seq_len)
    _check_keys("study", cfg["study"], LOCAL_DEFAULTS["study"])
    _check_keys("eval", cfg["eval"], LOCAL_DEFAULTS["eval"])
    _int("eval.batch_size", cfg["eval"]["batch_size"])
    _int("eval.max_sequences", cfg["eval"]["max_sequences"], lo=0)
    validate_local(cfg["local"], cfg["model"]["n_layers"])
    expand_study(cfg)  # validates every configuration of the sweep
    return cfg


def expand_study(cfg: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The study's configurations: every ``K x aux x mtp`` of ``cfg["study"]`` (K=1 once, as the
    end-to-end baseline), each ``{"K", "aux", "mtp", "run"}`` where ``run`` is a normalised
    configuration (see :func:`normalise_run`). Cells that compute the same thing (``first`` and
    ``all`` at K=2) share one ``run``. An empty ``study.K`` means the single ``local`` configuration.

    Raises:
        ConfigError: an invalid configuration in the sweep, or a study without K=1 (no baseline).
    """
    st = cfg["study"]
    ks, auxs, mtps = list(st["K"] or []), list(st["aux"] or []), list(st["mtp"] or [])
    base = {"model": dict(cfg["model"]), "train": dict(cfg["train"]), "local": dict(cfg["local"])}
    if not ks:
        validate_local(base["local"], cfg["model"]["n_layers"])
        run = normalise_run(base)
        return [{"K": run["local"]["K"], "aux": run["local"]["aux"], "mtp": "custom", "run": run}]
    if 1 not in ks:
        raise ConfigError(f"study.K={ks} must include 1: K=1 (end-to-end backprop) is the baseline every gap is measured against")
    if not auxs or not mtps:
        raise ConfigError("study.aux and study.mtp must each list at least one choice")
    cells = []
    for k in ks:
        _int("study.K entry", k)
        for aux in (["none"] if k == 1 else auxs):
            for mtp in (["off"] if k == 1 else mtps):
                loc = {**cfg["local"], "K": int(k), "aux": aux if k > 1 else cfg["local"]["aux"],
                       "mtp_boundaries": mtp_boundaries_for(mtp, int(k))}
                validate_local(loc, cfg["model"]["n_layers"])
                label = "off" if mtp is False else mtp if isinstance(mtp, str) else str(list(mtp))
                cells.append({"K": int(k), "aux": aux, "mtp": label,
                              "run": normalise_run({**base, "local": loc})})
    return cells


def boundaries(n_layers: int, k: int) -> list[int]:
    """Layer indices ``0 = b_0 < b_1 < ... < b_K = n_layers`` splitting ``n_layers`` layers into
    ``k`` consecutive groups as evenly as possible. Raises :class:`ConfigError` if ``k > n_layers``."""
    if not 1 <= k <= n_layers:
        raise ConfigError(f"K={k} blocks need 1 <= K <= {n_layers} (the layer count)")
    return [(j * n_layers) // k for j in range(k + 1)]


# ----------------------------------------------------------------------------- vocabulary

def vocab_ids(train: np.ndarray, val: np.ndarray, mode: str, tokenizer_vocab: int) -> np.ndarray:
    """The tokenizer ids the model's vocabulary covers, sorted, int64 ``[V]``.

    ``compact``: the ids occurring in the token store (train and val; a model over the full
    vocabulary spends its capacity on the same ids, and on CPU the LM heads dominate the cost);
    ``full``: ``0..tokenizer_vocab-1``.
    """
    if mode == "full":
        return np.arange(max(int(tokenizer_vocab), int(max(train.max(), val.max())) + 1), dtype=np.int64)
    return np.unique(np.concatenate([np.unique(train), np.unique(val)])).astype(np.int64)


def remap(tokens: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Renumber tokenizer ids ``tokens`` (``[n, T]``) into model ids via the sorted ``ids`` (int64).
    Raises ``ValueError`` if a token is not covered."""
    out = np.searchsorted(ids, tokens)
    if (out >= len(ids)).any() or (ids[np.minimum(out, len(ids) - 1)] != tokens).any():
        raise ValueError("a token id is outside the model's vocabulary")
    return out.astype(np.int64)


# ----------------------------------------------------------------------------- model

def llama_config(m: Mapping[str, Any], vocab_size: int, seq_len: int):
    """A ``LlamaConfig`` for the ``model`` section: untied embeddings (tying would let the last
    block's LM head send gradient into block 0's embedding), SDPA attention, no dropout."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=int(m["n_layers"]), hidden_size=int(m["hidden_size"]),
                      intermediate_size=int(m["intermediate_size"]), num_attention_heads=int(m["n_heads"]),
                      num_key_value_heads=int(m["n_kv_heads"]), vocab_size=int(vocab_size),
                      max_position_embeddings=int(seq_len), rope_theta=float(m["rope_theta"]),
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    return cfg


def _init_linear(module: nn.Module, std: float) -> None:
    for mod in module.modules():
        if isinstance(mod, nn.Linear):
            nn.init.normal_(mod.weight, 0.0, std)
            if mod.bias is not None:
                nn.init.zeros_(mod.bias)


class ResidualMLP(nn.Module):
    """``h + SwiGLU(RMSNorm(h))`` with the model's intermediate width; ``[B, T, d] → [B, T, d]``."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, h: torch.Tensor, ctx: Mapping[str, Any] | None = None) -> torch.Tensor:
        return h + self.mlp(self.norm(h))


class TransformerTrunk(nn.Module):
    """One Llama decoder layer (causal self-attention + MLP); ``[B, T, d] → [B, T, d]``."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        self.layer = LlamaDecoderLayer(config, layer_idx=0)

    def forward(self, h: torch.Tensor, ctx: Mapping[str, Any]) -> torch.Tensor:
        return self.layer(h, attention_mask=ctx["attention_mask"], position_embeddings=ctx["position_embeddings"],
                          position_ids=ctx["position_ids"], use_cache=False)


class AuxHead(nn.Module):
    """A local auxiliary head: trunk (``mlp`` or ``transformer``), RMSNorm, its own LM head
    (``d → V``), and ``mtp_n - 1`` MTP offset modules (residual MLPs on the trunk output that
    predict tokens ``t+2 .. t+mtp_n`` through the same norm and LM head).

    ``forward(h, ctx)`` maps hidden states ``[B, T, d]`` float32 to a list of logits
    ``[B, T, V]`` for offsets ``1..mtp_n`` (offset 1 = next token).
    """

    def __init__(self, kind: str, config, mtp_n: int = 1):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        if kind not in AUX_HEADS:
            raise ConfigError(f"unknown aux head {kind!r}; known: {', '.join(AUX_HEADS)}")
        self.kind = kind
        self.trunk = ResidualMLP(config) if kind == "mlp" else TransformerTrunk(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = nn.ModuleList([ResidualMLP(config) for _ in range(max(0, mtp_n - 1))])
        _init_linear(self, config.initializer_range)

    def forward(self, h: torch.Tensor, ctx: Mapping[str, Any]) -> list[torch.Tensor]:
        z = self.trunk(h, ctx)
        out = [self.lm_head(self.norm(z))]
        for m in self.mtp:
            out.append(self.lm_head(self.norm(m(z))))
        return out


def shifted_ce(logits: torch.Tensor, ids: torch.Tensor, offset: int = 1) -> torch.Tensor:
    """Mean CE (nats/token) of predicting ``ids[:, t + offset]`` from ``logits[:, t]``.

    Args:
        logits: ``[B, T, V]`` float. ids: ``[B, T]`` int64 model ids. offset: ``k >= 1``.

    Returns:
        A scalar over the ``B * (T - offset)`` valid positions. Raises ``ValueError`` if ``offset >= T``.
    """
    t = ids.shape[1]
    if not 1 <= offset < t:
        raise ValueError(f"offset {offset} needs 1 <= offset < seq_len={t}")
    pred = logits[:, : t - offset]
    return F.cross_entropy(pred.reshape(-1, pred.shape[-1]), ids[:, offset:].reshape(-1))


def mtp_targets(ids: torch.Tensor, n: int) -> list[torch.Tensor]:
    """The MTP targets for offsets ``1..n``: entry ``k-1`` is ``[B, T-k]`` with
    ``out[k-1][b, t] == ids[b, t + k]`` (the token ``k`` steps after position ``t``)."""
    return [ids[:, k:] for k in range(1, n + 1)]


class LocalLM(nn.Module):
    """A Llama causal LM split into ``K`` gradient-isolated blocks with aux heads at boundaries 1..K-1.

    Attributes:
        model: the ``LlamaForCausalLM`` (the deployable model; saved with ``save_pretrained``).
        bounds: ``[b_0=0, ..., b_K=n_layers]``. heads: ``ModuleList`` of ``K-1`` :class:`AuxHead`.
        mtp_boundaries: boundaries (1..K-1) whose heads add the MTP loss.
    """

    def __init__(self, model, k: int, aux: str = "mlp", mtp_boundaries: Iterable[int] = (), mtp_n: int = 2,
                 mtp_weight: float = 0.3, seed: int = 0):
        super().__init__()
        self.model = model
        self.k = int(k)
        self.bounds = boundaries(model.config.num_hidden_layers, self.k)
        self.aux = aux if self.k > 1 else "none"
        self.mtp_boundaries = sorted(int(b) for b in mtp_boundaries)
        self.mtp_n, self.mtp_weight = int(mtp_n), float(mtp_weight)
        validate_local({"K": self.k, "aux": self.aux, "mtp_boundaries": self.mtp_boundaries, "mtp_n": self.mtp_n,
                        "mtp_weight": self.mtp_weight}, model.config.num_hidden_layers)
        heads = []
        for b in range(1, self.k):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(block_seed(seed, 1000 + b))
                heads.append(AuxHead(aux, model.config, self.mtp_n if b in self.mtp_boundaries else 1))
        self.heads = nn.ModuleList(heads)
        self.heads.to(next(model.parameters()).device)

    # -- structure
    def block_modules(self, j: int) -> list[nn.Module]:
        """Modules owned by block ``j`` (embedding in block 0; norm and LM head in the last; aux head)."""
        inner = self.model.model
        mods: list[nn.Module] = [inner.embed_tokens] if j == 0 else []
        mods += list(inner.layers[self.bounds[j]: self.bounds[j + 1]])
        mods += [inner.norm, self.model.lm_head] if j == self.k - 1 else [self.heads[j]]
        return mods

    def block_params(self, j: int) -> list[nn.Parameter]:
        """Parameters of block ``j`` in module order (for K=1: exactly ``model.parameters()``)."""
        return [p for m in self.block_modules(j) for p in m.parameters()]

    # -- forward pieces
    def context(self, ids: torch.Tensor) -> dict[str, Any]:
        """Per-batch, gradient-free inputs every layer needs: causal mask, rotary cos/sin, positions
        (computed as ``LlamaModel.forward`` does; ids ``[B, T]`` int64)."""
        from transformers.masking_utils import create_causal_mask

        inner = self.model.model
        probe = torch.empty(ids.shape[0], ids.shape[1], inner.config.hidden_size, device=ids.device,
                            dtype=inner.embed_tokens.weight.dtype)
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        # positional: the 4th argument (no KV cache) is `cache` in transformers >= 5.2x, `past_key_values` before
        mask = create_causal_mask(inner.config, probe, None, None, position_ids=pos)
        return {"attention_mask": mask, "position_ids": pos, "position_embeddings": inner.rotary_emb(probe, position_ids=pos)}

    def run_block(self, j: int, x: torch.Tensor, ctx: Mapping[str, Any]) -> torch.Tensor:
        """Block ``j``'s layers: ids ``[B, T]`` (block 0) or hidden ``[B, T, d]`` → hidden ``[B, T, d]``."""
        inner = self.model.model
        h = inner.embed_tokens(x) if j == 0 else x
        for layer in inner.layers[self.bounds[j]: self.bounds[j + 1]]:
            h = layer(h, attention_mask=ctx["attention_mask"], position_embeddings=ctx["position_embeddings"],
                      position_ids=ctx["position_ids"], use_cache=False)
        return h

    def boundary_logits(self, j: int, h: torch.Tensor, ctx: Mapping[str, Any]) -> list[torch.Tensor]:
        """Logits ``[B, T, V]`` at boundary ``j + 1`` (offsets 1..n; the final block: its own norm and LM head)."""
        if j == self.k - 1:
            return [self.model.lm_head(self.model.model.norm(h))]
        return self.heads[j](h, ctx)

    def block_loss(self, j: int, h: torch.Tensor, ids: torch.Tensor, ctx: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """Block ``j``'s local loss (nats/token) from its output ``h``: next-token CE, plus
        ``mtp_weight * mean_k CE_k`` over offsets ``k = 2..n`` at an MTP boundary.
        Returns ``(loss, {"ce": ..., "mtp": ...})``."""
        logits = self.boundary_logits(j, h, ctx)
        ce = shifted_ce(logits[0], ids, 1)
        info = {"ce": float(ce.detach())}
        if len(logits) > 1:
            mtp = torch.stack([shifted_ce(lg, ids, k) for k, lg in enumerate(logits[1:], start=2)]).mean()
            info["mtp"] = float(mtp.detach())
            return ce + self.mtp_weight * mtp, info
        return ce, info

    def block_losses(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Every block's loss on ``ids`` ``[B, T]`` in one forward, each block reading the previous
        block's output detached (the gradient-isolated graph). Returns ``K`` scalar tensors."""
        ctx = self.context(ids)
        x, losses = ids, []
        for j in range(self.k):
            h = self.run_block(j, x if j == 0 else x.detach(), ctx)
            losses.append(self.block_loss(j, h, ids, ctx)[0])
            x = h
        return losses


def build_local(run: Mapping[str, Any], vocab_size: int, seq_len: int, device: str = "cpu") -> LocalLM:
    """Initialise a :class:`LocalLM` for a normalised configuration ``run``: the Llama model from
    ``torch.manual_seed(train.seed)`` (exactly as ``AutoModelForCausalLM.from_config`` after that
    seed), aux heads from their own derived seeds (so K=1's model is untouched by head creation)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(int(run["train"]["seed"]))
    model = AutoModelForCausalLM.from_config(llama_config(run["model"], vocab_size, seq_len)).to(device)
    loc = run["local"]
    return LocalLM(model, loc["K"], loc["aux"] if loc["K"] > 1 else "mlp", loc["mtp_boundaries"], loc["mtp_n"] if loc["mtp_boundaries"] else 2,
                   loc["mtp_weight"], seed=int(run["train"]["seed"]))


# ----------------------------------------------------------------------------- data order

def batch_indices(n: int, batch_size: int, data_seed: int, step: int) -> np.ndarray:
    """Rows of the train split in batch ``step``: a stream of per-epoch permutations
    (``zgcore.train.data_order(n, data_seed, epoch)``) read ``batch_size`` at a time. A pure
    function of its arguments, so every configuration with the same data seed and batch size sees
    the same token ids in the same order. Returns ``[batch_size]`` int64."""
    lo = step * batch_size
    out = []
    while len(out) < batch_size:
        epoch, pos = divmod(lo + len(out), n)
        perm = data_order(n, data_seed, epoch)
        out.extend(perm[pos: pos + batch_size - len(out)].tolist())
    return np.asarray(out, dtype=np.int64)


def steps_for(t: Mapping[str, Any], seq_len: int) -> int:
    """Optimizer steps for the token budget: ``token_budget // (batch_size * seq_len)``."""
    return int(t["token_budget"]) // (int(t["batch_size"]) * int(seq_len))


# ----------------------------------------------------------------------------- execution

def _zero(opts):
    for o in opts:
        o.zero_grad(set_to_none=True)


def step_together(lm: LocalLM, ids: torch.Tensor, opts: list, grad_clip: float) -> list[dict[str, float]]:
    """All blocks on one batch: every forward, one backward over the sum of the block losses
    (the detached inputs keep the blocks' gradients separate), then each optimizer steps.
    Returns per-block loss info."""
    _zero(opts)
    ctx = lm.context(ids)
    x, losses, infos = ids, [], []
    for j in range(lm.k):
        h = lm.run_block(j, x if j == 0 else x.detach(), ctx)
        loss, info = lm.block_loss(j, h, ids, ctx)
        losses.append(loss)
        infos.append(info)
        x = h
    total = sum(losses[1:], losses[0])
    total.backward()
    for j, o in enumerate(opts):
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(lm.block_params(j), grad_clip)
        o.step()
    return infos


def step_per_block(lm: LocalLM, ids: torch.Tensor, opts: list, grad_clip: float) -> list[dict[str, float]]:
    """Deployment-style: block by block, forward, backward and optimizer step, keeping only the
    detached boundary activation ``[B, T, d]`` for the next block (its graph is freed first).
    Computes the same update as :func:`step_together`. Returns per-block loss info."""
    ctx = lm.context(ids)
    x, infos = ids, []
    for j in range(lm.k):
        opts[j].zero_grad(set_to_none=True)
        h = lm.run_block(j, x, ctx)
        loss, info = lm.block_loss(j, h, ids, ctx)
        loss.backward()
        x = h.detach()
        del h, loss
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(lm.block_params(j), grad_clip)
        opts[j].step()
        infos.append(info)
    return infos


STEPS = {"together": step_together, "per_block": step_per_block}


class SavedTensorMeter:
    """Measure activation memory as the bytes autograd keeps for backward, live, and their peak.

    Inside the context every tensor saved for backward passes through
    ``torch.autograd.graph.saved_tensors_hooks``; its storage is counted once (by data pointer,
    ``untyped_storage().nbytes()``) while any saved reference to it lives, and released when the
    graph frees it (after backward, or when dropped). Parameters (and views of them) are not
    activations and are excluded. ``peak_bytes`` is the maximum live total (bytes).

    Why this and not a formula or RSS: on CPU the process's resident size is dominated by the
    allocator's caching and the other tensors of the process, and torch has no CPU peak counter;
    the saved-tensor set *is* the activation memory the two execution modes differ in, measured
    on the real forward/backward. On CUDA :func:`measure_activation_memory` additionally reports
    ``torch.cuda.max_memory_allocated`` above the pre-forward baseline.
    """

    def __init__(self, params: Iterable[torch.Tensor]):
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self._refs: dict[int, int] = {}
        self._size: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def _pack(self, t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key in self._param_ptrs or t.untyped_storage().nbytes() == 0:
            return t
        if self._refs.get(key, 0) == 0:
            self._size[key] = t.untyped_storage().nbytes()
            self.live_bytes += self._size[key]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._refs[key] = self._refs.get(key, 0) + 1
        return _Saved(t, self, key)

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            self.live_bytes -= self._size.pop(key)
            del self._refs[key]

    @staticmethod
    def _unpack(obj):
        return obj.tensor if isinstance(obj, _Saved) else obj

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        return False


class _Saved:
    """A saved tensor held by the autograd graph; when the graph drops it, its count is released."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor, meter, key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter._release(self.key)


def measure_activation_memory(lm: LocalLM, ids: torch.Tensor, mode: str) -> dict[str, Any]:
    """Peak activation memory of one forward+backward of ``lm`` on ``ids`` ``[B, T]`` in execution
    ``mode`` (no optimizer step; gradients are cleared afterwards, so parameters are untouched).

    Returns:
        ``{"mode", "saved_peak_bytes", "cuda_peak_bytes"}``: bytes, the second ``None`` off CUDA.
        Raises :class:`ConfigError` for an unknown mode.
    """
    if mode not in EXECUTIONS:
        raise ConfigError(f"execution mode must be one of {EXECUTIONS}, got {mode!r}")
    params = list(lm.parameters())
    cuda = ids.is_cuda
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    meter = SavedTensorMeter(params)
    with meter:
        ctx = lm.context(ids)
        if mode == "together":
            losses = lm.block_losses(ids)
            sum(losses[1:], losses[0]).backward()
            del losses
        else:
            x = ids
            for j in range(lm.k):
                h = lm.run_block(j, x, ctx)
                loss = lm.block_loss(j, h, ids, ctx)[0]
                loss.backward()
                x = h.detach()
                del h, loss
    cuda_peak = None
    if cuda:
        torch.cuda.synchronize()
        cuda_peak = int(torch.cuda.max_memory_allocated() - base)
    for p in params:
        p.grad = None
    return {"mode": mode, "saved_peak_bytes": int(meter.peak_bytes), "cuda_peak_bytes": cuda_peak}


def train_local(lm: LocalLM, train_tokens: np.ndarray, t: Mapping[str, Any], device: str = "cpu",
                progress: Callable[[int, int, list[dict[str, float]]], None] | None = None,
                log_path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Pretrain ``lm`` on ``train_tokens`` (``[n, T]`` model ids, int64) for the token budget.

    Each block has its own AdamW (``lr`` with linear warmup then cosine to 10%, ``weight_decay``,
    gradient clipping per block); batches follow :func:`batch_indices` with ``data_seed``.
    Before the first step, peak activation memory of the first batch is measured in both
    execution modes (:func:`measure_activation_memory`). ``log_path`` gets a CSV of per-block losses.

    Returns:
        ``{"steps", "tokens", "tokens_sha256" (of the int64 model ids seen, in order), "seconds",
        "first_loss", "final_loss" (per block, nats/token, final = mean of the last 10 steps),
        "memory": {mode: measurement}, "memory_ratio" (together / per_block)}``.
    """
    seq_len = train_tokens.shape[1]
    steps = steps_for(t, seq_len)
    bsz = int(t["batch_size"])
    opts = [torch.optim.AdamW(lm.block_params(j), lr=float(t["lr"]), weight_decay=float(t["weight_decay"]))
            for j in range(lm.k)]
    step_fn = STEPS[t["execution"]]
    first = torch.as_tensor(train_tokens[batch_indices(len(train_tokens), bsz, int(t["data_seed"]), 0)], device=device)
    memory = {m: measure_activation_memory(lm, first, m) for m in EXECUTIONS}
    lm.train()
    sha = hashlib.sha256()
    rows, t0 = [], time.perf_counter()
    for step in range(steps):
        idx = batch_indices(len(train_tokens), bsz, int(t["data_seed"]), step)
        batch = np.ascontiguousarray(train_tokens[idx], dtype=np.int64)
        sha.update(batch.tobytes())
        ids = torch.as_tensor(batch, device=device)
        lr = lr_at(step, steps, float(t["lr"]), int(t["warmup_steps"]))
        for o in opts:
            for g in o.param_groups:
                g["lr"] = lr
        infos = step_fn(lm, ids, opts, float(t["grad_clip"]))
        rows.append([step, lr] + [i["ce"] for i in infos] + [i.get("mtp", float("nan")) for i in infos])
        if progress and (step % int(t.get("log_every", 10)) == 0 or step == steps - 1):
            progress(step + 1, steps, infos)
    seconds = time.perf_counter() - t0
    if log_path:
        with open(log_path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "lr"] + [f"ce_b{j + 1}" for j in range(lm.k)] + [f"mtp_b{j + 1}" for j in range(lm.k)])
            w.writerows(rows)
    arr = np.asarray([r[2: 2 + lm.k] for r in rows], dtype=np.float64)
    sp = {m: memory[m]["saved_peak_bytes"] for m in EXECUTIONS}
    return {"steps": steps, "tokens": steps * bsz * seq_len, "tokens_sha256": sha.hexdigest(), "seconds": seconds,
            "first_loss": arr[0].tolist(), "final_loss": arr[-10:].mean(0).tolist(), "memory": memory,
            "memory_ratio": sp["together"] / sp["per_block"] if sp["per_block"] else float("nan")}


# ----------------------------------------------------------------------------- evaluation, saving

@torch.no_grad()
def evaluate_local(lm: LocalLM, tokens: np.ndarray, batch_size: int = 16) -> dict[str, Any]:
    """Held-out next-token CE (nats/token) at every boundary ``1..K`` (aux heads, then the model's
    own head at boundary K) over ``tokens`` ``[n, T]`` model ids, averaged over ``n * (T-1)``
    predictions. Returns ``{"boundary_ce": [K floats], "final_ce": boundary_ce[-1]}``."""
    lm.eval()
    device = next(lm.parameters()).device
    tot = np.zeros(lm.k)
    count = 0
    for lo in range(0, len(tokens), batch_size):
        ids = torch.as_tensor(tokens[lo: lo + batch_size], dtype=torch.long, device=device)
        ctx = lm.context(ids)
        x = ids
        for j in range(lm.k):
            x = lm.run_block(j, x, ctx)
            lg = lm.boundary_logits(j, x, ctx)[0][:, :-1].float()
            tot[j] += F.cross_entropy(lg.reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum").item()
        count += ids[:, 1:].numel()
    ce = (tot / count).tolist()
    return {"boundary_ce": ce, "final_ce": ce[-1]}


def save_local(path: str | os.PathLike, lm: LocalLM, ids: np.ndarray, run: Mapping[str, Any]) -> None:
    """Write ``model/`` (a plain HF Llama folder), ``aux_heads.safetensors``, ``vocab_ids.npy``
    (tokenizer id of each model id) and ``local.json`` (K, bounds, aux, MTP, run) into ``path``."""
    from safetensors.torch import save_file

    path = Path(path)
    lm.model.save_pretrained(path / "model")
    save_file({k: v.contiguous() for k, v in lm.heads.state_dict().items()} or {"_empty": torch.zeros(0)},
              str(path / "aux_heads.safetensors"))
    np.save(path / "vocab_ids.npy", ids)
    (path / "local.json").write_text(json.dumps({"K": lm.k, "bounds": lm.bounds, "aux": lm.aux,
                                                 "mtp_boundaries": lm.mtp_boundaries, "mtp_n": lm.mtp_n,
                                                 "mtp_weight": lm.mtp_weight, "run": run}, indent=2, sort_keys=True) + "\n")


def load_local(path: str | os.PathLike, device: str = "cpu") -> tuple[LocalLM, np.ndarray]:
    """Load what :func:`save_local` wrote. Returns ``(lm, vocab_ids)``."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = Path(path)
    meta = json.loads((path / "local.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(path / "model", dtype=torch.float32, attn_implementation="sdpa").to(device)
    lm = LocalLM(model, meta["K"], meta["aux"] if meta["K"] > 1 else "mlp", meta["mtp_boundaries"],
                 meta["mtp_n"] if meta["mtp_boundaries"] else 2, meta["mtp_weight"])
    sd = {k: v for k, v in load_file(str(path / "aux_heads.safetensors")).items() if k != "_empty"}
    lm.heads.load_state_dict(sd)
    lm.heads.to(device)
    return lm, np.load(path / "vocab_ids.npy")


# ----------------------------------------------------------------------------- study report

def _mtp_label(cell: Mapping[str, Any]) -> str:
    b = cell["run"]["local"]["mtp_boundaries"]
    return "off" if not b else f"{cell['mtp']} ({','.join(map(str, b))}; n={cell['run']['local']['mtp_n']})"


def study_report(name: str, tokenizer: str, seq_len: int, cells: list[Mapping[str, Any]],
                 results: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Assemble the study report from its cells and each cell's ``{"train": metrics, "eval": eval}``.

    Gap = held-out CE (nats/token) minus the K=1 end-to-end CE of the same study (same model,
    seed and token budget). Memory: peak saved-activation bytes in both execution modes and their
    ratio (together / per-block).

    Raises:
        RuntimeError: the configurations did not see the same tokens (budget matching broken) or no K=1 cell.
    """
    shas = {r["train"]["tokens_sha256"] for r in results}
    toks = {r["train"]["tokens"] for r in results}
    if len(shas) != 1 or len(toks) != 1:
        raise RuntimeError(f"token-budget matching failed: configurations saw different token streams ({len(shas)} distinct)")
    base = [r for c, r in zip(cells, results) if c["K"] == 1]
    if not base:
        raise RuntimeError("the study has no K=1 (end-to-end) configuration to measure gaps against")
    e2e = base[0]["eval"]["held_out_ce"]
    rows = []
    for c, r in zip(cells, results):
        mem = r["train"]["memory"]
        rows.append({"K": c["K"], "aux": c["aux"], "mtp": c["mtp"], "mtp_label": _mtp_label(c),
                     "mtp_boundaries": c["run"]["local"]["mtp_boundaries"], "held_out_ce": r["eval"]["held_out_ce"],
                     "gap": r["eval"]["held_out_ce"] - e2e, "boundary_ce": r["eval"]["boundary_ce"],
                     "mem_together_bytes": mem["together"]["saved_peak_bytes"],
                     "mem_per_block_bytes": mem["per_block"]["saved_peak_bytes"],
                     "mem_together_cuda_bytes": mem["together"]["cuda_peak_bytes"],
                     "mem_per_block_cuda_bytes": mem["per_block"]["cuda_peak_bytes"],
                     "memory_ratio": r["train"]["memory_ratio"], "train_seconds": r["train"]["seconds"],
                     "parameters": r["train"].get("parameters"), "dir": r.get("dir")})
    t0 = results[0]["train"]
    model = cells[0]["run"]["model"]
    return {"name": name, "tokenizer": tokenizer, "seq_len": int(seq_len), "model": model,
            "vocab_size": t0.get("vocab_size"), "model_parameters": base[0]["train"].get("parameters"),
            "token_budget": {"tokens": t0["tokens"], "steps": t0["steps"], "batch_size": cells[0]["run"]["train"]["batch_size"],
                             "tokens_sha256": t0["tokens_sha256"], "matched": True},
            "val_tokens": results[0]["eval"]["val_tokens"], "e2e_ce": e2e, "rows": rows,
            "max_memory_ratio": max(r["memory_ratio"] for r in rows)}


def report_markdown(rep: Mapping[str, Any]) -> str:
    """Render :func:`study_report`'s dict as Markdown (CE in nats/token, memory in MiB)."""
    mib = lambda b: f"{b / 2 ** 20:.1f}"
    tb = rep["token_budget"]
    m = rep["model"]
    lines = [f"# Greedy local learning study — {rep['name']}", "",
             f"Model: Llama-style, {m['n_layers']} layers, hidden {m['hidden_size']}, {m['n_heads']} heads, "
             f"vocab {rep['vocab_size']} ({m['vocab']}), {rep['model_parameters']:,} parameters (K=1; aux heads extra). "
             f"Tokenizer `{rep['tokenizer']}`, sequences of {rep['seq_len']} tokens.", "",
             f"**Token budget: {tb['tokens']:,} training tokens per configuration** ({tb['steps']} steps x "
             f"{tb['batch_size']} x {rep['seq_len']}); every configuration saw exactly the same token ids in the same "
             f"order (sha256 `{tb['tokens_sha256'][:16]}`). Held-out CE over {rep['val_tokens']:,} predicted tokens.", "",
             "| K | aux head | MTP (boundaries) | held-out CE | gap to E2E | CE at boundaries 1..K | act. mem together (MiB) | per-block (MiB) | ratio | train s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        lines.append(f"| {r['K']} | {r['aux']} | {r['mtp_label']} | {r['held_out_ce']:.4f} | {r['gap']:+.4f} | "
                     f"{' / '.join(f'{c:.3f}' for c in r['boundary_ce'])} | {mib(r['mem_together_bytes'])} | "
                     f"{mib(r['mem_per_block_bytes'])} | {r['memory_ratio']:.2f}x | {r['train_seconds']:.0f} |")
    lines += ["", f"E2E (K=1) held-out CE: {rep['e2e_ce']:.4f} nats/token. Gap = configuration CE minus E2E CE "
              "at the same token budget (positive = worse than end-to-end).", "",
              f"Activation memory: peak bytes autograd keeps for backward (saved tensors, parameters excluded), "
              f"measured on the first training batch in both execution modes. Largest together/per-block ratio: "
              f"**{rep['max_memory_ratio']:.2f}x** (the paper reports up to 2.2x).", "",
              "![gap vs K](gap_vs_k.png)", ""]
    return "\n".join(lines)


def plot_gap_vs_k(rep: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Plot gap to end-to-end (nats/token) against K, one line per aux head x MTP choice (K=1 at 0); PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    variants = sorted({(r["aux"], r["mtp"]) for r in rep["rows"] if r["K"] > 1})
    for aux, mtp in variants:
        pts = [(1, 0.0)] + sorted((r["K"], r["gap"]) for r in rep["rows"] if r["K"] > 1 and r["aux"] == aux and r["mtp"] == mtp)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linestyle="-" if aux == "transformer" else "--",
                label=f"{aux}, MTP {mtp}")
    ax.axhline(0, color="grey", linewidth=0.8)
    ks = sorted({r["K"] for r in rep["rows"]})
    ax.set_xticks(ks)
    ax.set_xlabel("K (gradient-isolated blocks)")
    ax.set_ylabel("held-out CE gap to end-to-end (nats/token)")
    ax.set_title(f"{rep['name']}: {rep['token_budget']['tokens']:,} tokens per configuration")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
