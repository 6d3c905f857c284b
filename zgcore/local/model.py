"""Local-learning model: the Llama LM split into K gradient-isolated blocks, its auxiliary heads
(``mlp`` / ``transformer`` trunks, MTP offset modules), the per-block forward (written once:
:meth:`LocalLM.blocks`), the local losses, the model vocabulary, and saving/loading a trained one.

Source: "Greedy Local Learning for Language Model Pretraining: Gaps and Objective Design"
(arXiv 2610.04867).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from zgcore.checks import ConfigError
from zgcore.training.blocks import block_seed
from .config import AUX_HEADS, boundaries, validate_local

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
        self.aux = aux if self.k > 1 else "none"
        self.mtp_boundaries = sorted(int(b) for b in mtp_boundaries)
        self.mtp_n, self.mtp_weight = int(mtp_n), float(mtp_weight)
        validate_local({"K": self.k, "aux": self.aux, "mtp_boundaries": self.mtp_boundaries, "mtp_n": self.mtp_n,
                        "mtp_weight": self.mtp_weight}, model.config.num_hidden_layers)
        self.bounds = boundaries(model.config.num_hidden_layers, self.k)
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

    def block_loss(self, j: int, h: torch.Tensor, ids: torch.Tensor, ctx: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Block ``j``'s local loss (nats/token) from its output ``h``: next-token CE, plus
        ``mtp_weight * mean_k CE_k`` over offsets ``k = 2..n`` at an MTP boundary.
        Returns ``(loss, {"ce": ..., "mtp": ...})``, the terms as detached 0-dim tensors on the
        model's device (read back by the training loop with the others, not one by one)."""
        logits = self.boundary_logits(j, h, ctx)
        ce = shifted_ce(logits[0], ids, 1)
        info = {"ce": ce.detach()}
        if len(logits) > 1:
            mtp = torch.stack([shifted_ce(lg, ids, k) for k, lg in enumerate(logits[1:], start=2)]).mean()
            info["mtp"] = mtp.detach()
            return ce + self.mtp_weight * mtp, info
        return ce, info

    def blocks(self, ids: torch.Tensor, ctx: Mapping[str, Any] | None = None, losses: bool = True
               ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None, dict[str, float]]]:
        """The per-block forward of local learning, written once: for ``j = 0..K-1`` yield
        ``(j, h_j, loss_j, info_j)`` where block ``j`` reads block ``j-1``'s output *detached* (no
        gradient crosses a boundary) and ``loss_j`` is :meth:`block_loss`. Block ``j+1`` runs only
        when the next item is asked for, so a caller may backward and step block ``j`` first
        (``per_block`` execution) or collect every loss (``together``).

        Args:
            ids: ``[B, T]`` int64 model ids. ctx: :meth:`context` of ``ids`` (computed if ``None``).
            losses: ``False`` yields ``(j, h_j, None, {})`` (the forward only).
        """
        ctx = self.context(ids) if ctx is None else ctx
        x = ids
        for j in range(self.k):
            h = self.run_block(j, x, ctx)
            loss, info = self.block_loss(j, h, ids, ctx) if losses else (None, {})
            yield j, h, loss, info
            x = h.detach()

    def block_losses(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Every block's loss on ``ids`` ``[B, T]`` in one gradient-isolated forward (:meth:`blocks`).
        Returns ``K`` scalar tensors."""
        return [loss for _, _, loss, _ in self.blocks(ids)]


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


