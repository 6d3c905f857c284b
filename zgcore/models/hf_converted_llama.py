"""A Llama whose token mixers are not all softmax attention: the modelling code that a converted
student's folder carries (``trust_remote_code``), with its sibling :mod:`hf_linear_attention` (the
chunked and banded sums). Imports nothing but ``torch``, ``transformers`` and that sibling.

One set of weights, two forms. Every mixer has a *parallel* form (training, evaluation, prompt
prefill: all positions at once; ``O(T^2)`` for training and scoring on the CPU, chunked in ``O(T)``
memory for a prefill) and a *recurrent* form (decoding: one token at a time on a state of fixed
size), and both give the same outputs up to float rounding:

* ``softmax``: the teacher's causal attention; recurrent state = every key and value (grows).
* ``window``: softmax over the last ``window`` tokens (the current one included); state = a ring of
  ``window`` keys and values.
* ``linear``: causal linear attention ``y_i = sum_j phi_q(q_i).phi_k(k_j) v_j / sum_j phi_q(q_i).phi_k(k_j)``
  with Hedgehog's learned feature map per head (Zhang et al. 2024, "The Hedgehog & the Porcupine",
  arXiv:2402.04347): ``phi(x) = [softmax(x W), softmax(-x W)]`` over ``2 * head_dim`` features;
  state = ``S = sum_j phi_k(k_j) v_j^T`` ``[heads, 2d, d]`` and ``z = sum_j phi_k(k_j)`` ``[heads, 2d]``.
* ``linear_window``: LoLCATs' hybrid (Zhang et al. 2024, "LoLCATs", arXiv:2410.10254): ``exp`` scores
  inside the window weighted ``f``, ``phi_q.phi_k`` beyond it weighted ``1 - f``, one normaliser over
  both (``f = sigmoid(window_factor)``, a learned factor per head); the ``exp`` scores are
  stabilised by the maximum score inside the window, as LoLCATs does; state = the ring plus ``S, z``
  of the tokens that have left the window.
* ``none``: no attention sub-layer (Puzzle's no-op; Bercovich et al. 2024, arXiv:2411.19146).

On CUDA with flash-linear-attention (``fla``, Yang et al.) installed, the parallel form of ``linear``
and ``linear_window`` runs fla's ``chunk_linear_attn`` with no ``T x T`` matrix (the part beyond the
window on keys and values shifted by ``window``, the softmax part over bands of ``2 * window`` keys);
elsewhere the PyTorch form computes the same sums. ``ZGMixer.kernel``: ``"auto"`` (default),
``"torch"`` or ``"fla"`` (``ImportError`` without it). fla is optional.

Queries and keys keep the teacher's rotary positions (applied before the feature map and before
keys enter the ring, so the ring holds rotated keys and its order does not matter). ``W`` starts as
the identity and queries and keys enter it scaled by ``head_dim ** -0.25`` each (their product
carries softmax attention's ``1/sqrt(d)``). Padding masks are not supported (every row is one
sequence from position 0): a mask with a zero raises ``ValueError``.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, apply_rotary_pos_emb

from .hf_linear_attention import KERNELS, chunked_linear_attn, fla_linear_attn, window_terms

MIXERS = ("softmax", "window", "linear", "linear_window", "none")
WINDOWED = ("window", "linear_window")  # mixers that read the window
FEATURED = ("linear", "linear_window")  # mixers with a learned feature map
# linear_window's window factor starts at sigmoid(4) = 0.982 on the softmax terms, 0.018 on the linear ones:
# the student starts near the window-only student, which is closer to the teacher than an even mix
WINDOW_FACTOR_INIT = 4.0


def hedgehog(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Hedgehog's feature map: ``x`` ``[B, H, T, d]``, ``w`` ``[H, d, d]`` -> ``[B, H, T, 2d]``, each
    row two softmaxes over ``d`` features (positive, sums to 2)."""
    z = torch.einsum("bhtd,hde->bhte", x, w)
    return torch.cat([torch.softmax(z, -1), torch.softmax(-z, -1)], -1)


class MixerState:
    """One layer's recurrent state: ``seen`` tokens so far; ``k``/``v`` (every key and value for
    ``softmax``, a ring of ``window`` slots for the windowed mixers, ``[B, kv_heads, n, d]``); ``s``
    ``[B, H, 2d, d]`` and ``z`` ``[B, H, 2d]`` for the linear part."""

    def __init__(self):
        self.seen = 0
        self.k = self.v = self.s = self.z = None

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the state holds (what its bytes are)."""
        return [t for t in (self.k, self.v, self.s, self.z) if t is not None]


class ZGRecurrentCache:
    """The decode state of a converted model: one :class:`MixerState` per layer. Its size is fixed
    for ``window``, ``linear``, ``linear_window`` and ``none`` layers; ``softmax`` layers grow."""

    def __init__(self, n_layers: int):
        self.states = [MixerState() for _ in range(n_layers)]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens consumed so far."""
        return self.states[layer_idx].seen

    def nbytes(self) -> int:
        """Bytes held by every layer's state."""
        return sum(t.numel() * t.element_size() for s in self.states for t in s.tensors())


class ZGMixer(nn.Module):
    """A token mixer with the teacher attention's projections (``q_proj``, ``k_proj``, ``v_proj``,
    ``o_proj``, absent for ``none``) and, for the linear mixers, feature maps ``feature_q`` and
    ``feature_k`` ``[heads, head_dim, head_dim]`` (identity at start).

    ``forward(hidden_states [B, T, hidden], position_embeddings=(cos, sin))`` returns
    ``(output [B, T, hidden], None)``; with a ``cache`` (:class:`ZGRecurrentCache`) it runs the
    recurrent form and updates that layer's state. Raises ``ValueError`` for an unknown mixer or a
    window < 1. ``kernel`` (``"auto"``, ``"torch"``, ``"fla"``): which parallel form the linear
    mixers run (module docstring).
    """

    def __init__(self, config, layer_idx: int, mixer: str, window: int = 64):
        super().__init__()
        if mixer not in MIXERS:
            raise ValueError(f"unknown mixer {mixer!r}; known: {', '.join(MIXERS)}")
        if mixer in WINDOWED and int(window) < 1:
            raise ValueError(f"mixer {mixer!r} needs a window >= 1, got {window}")
        self.mixer, self.window, self.layer_idx = mixer, int(window), layer_idx
        self.kernel = "auto"
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = self.head_dim ** -0.5
        if mixer == "none":
            return
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)
        if mixer in FEATURED:
            eye = torch.eye(self.head_dim).expand(self.heads, -1, -1).clone()
            self.feature_q = nn.Parameter(eye)
            self.feature_k = nn.Parameter(eye.clone())
        if mixer == "linear_window":  # LoLCATs' window factor per head: sigmoid weight of the softmax terms
            self.window_factor = nn.Parameter(torch.full((self.heads,), float(WINDOW_FACTOR_INIT)))

    def _factor(self) -> torch.Tensor:
        return torch.sigmoid(self.window_factor).view(1, -1, 1, 1)

    # -- pieces shared by both forms
    def _rep(self, x: torch.Tensor) -> torch.Tensor:
        n = self.heads // self.kv_heads
        return x if n == 1 else x.repeat_interleave(n, dim=1)

    def _phi_q(self, q: torch.Tensor) -> torch.Tensor:
        return hedgehog(q * self.scaling ** 0.5, self.feature_q)

    def _phi_k(self, k: torch.Tensor) -> torch.Tensor:
        return hedgehog(self._rep(k) * self.scaling ** 0.5, self.feature_k)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                past_key_values=None, **kwargs):
        """``hidden_states`` ``[B, T, hidden]`` (normalised layer input), ``position_embeddings`` the
        rotary ``(cos, sin)`` of its positions -> ``(output [B, T, hidden], None)``; the causal mask is
        the mixer's own (``attention_mask`` is not read). With a :class:`ZGRecurrentCache` the
        recurrent form runs (an empty state is prefilled in parallel)."""
        cache = cache if cache is not None else past_key_values
        if self.mixer == "none":
            if isinstance(cache, ZGRecurrentCache):
                cache.states[self.layer_idx].seen += hidden_states.shape[1]
            return torch.zeros_like(hidden_states), None
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if not isinstance(cache, ZGRecurrentCache):
            y = self.parallel(q, k, v)
        else:
            state = cache.states[self.layer_idx]
            if state.seen == 0:
                y = self.parallel(q, k, v, chunked=True)
                self.prefill(state, q, k, v)
            else:
                y = torch.cat([self.step(state, q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1])
                               for i in range(t)], 2)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1)), None

    def parallel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunked: bool = False) -> torch.Tensor:
        """All positions at once: ``q`` ``[B, H, T, d]``, ``k``/``v`` ``[B, kv_heads, T, d]`` (rotated)
        -> ``[B, H, T, d]``. ``chunked`` (a prompt's prefill): the windowed and linear mixers never
        form a ``T x T`` matrix (:meth:`_parallel_chunked`), on any device; training and scoring
        keep the ``T x T`` form on the CPU (its bytes are what the recorded outputs hold)."""
        fla = self.mixer in FEATURED and self._use_fla(q)
        if self.mixer in ("window", *FEATURED) and (chunked or fla):
            return self._parallel_chunked(q, k, v, fla)
        n = q.shape[2]
        i = torch.arange(n, device=q.device)
        causal = i[None, :] <= i[:, None]  # [query, key]
        if self.mixer == "softmax":
            return F.scaled_dot_product_attention(q, self._rep(k), self._rep(v), is_causal=True, scale=self.scaling)
        inside = causal & (i[None, :] > i[:, None] - self.window)
        if self.mixer == "window":
            return F.scaled_dot_product_attention(q, self._rep(k), self._rep(v), attn_mask=inside, scale=self.scaling)
        lin = self._phi_q(q) @ self._phi_k(k).transpose(-1, -2)
        if self.mixer == "linear":
            a = lin * causal
        else:
            s = (q @ self._rep(k).transpose(-1, -2) * self.scaling).masked_fill(~inside, float("-inf"))
            f = self._factor()
            a = f * torch.exp(s - s.amax(-1, keepdim=True)) + (1 - f) * lin * (causal & ~inside)
        return (a @ self._rep(v)) / a.sum(-1, keepdim=True)

    def _use_fla(self, q: torch.Tensor) -> bool:
        if self.kernel not in KERNELS:
            raise ValueError(f"unknown kernel {self.kernel!r}; known: {', '.join(KERNELS)}")
        if self.kernel == "fla" and fla_linear_attn() is None:
            raise ImportError("kernel 'fla' needs flash-linear-attention and Triton: pip install flash-linear-attention")
        if self.kernel == "fla" and not q.is_cuda and getattr(fla_linear_attn(), "__module__", "").startswith("fla"):
            raise ValueError(f"kernel 'fla' needs CUDA tensors (fla's Triton kernels have no CPU path), got {q.device}")
        return self.kernel == "fla" or (self.kernel == "auto" and q.is_cuda and fla_linear_attn() is not None)

    def _parallel_chunked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fla: bool) -> torch.Tensor:
        """:meth:`parallel` of ``window`` / ``linear`` / ``linear_window`` in ``O(T)`` memory: the linear
        terms through a chunked kernel (fla's where ``fla``, else :func:`chunked_linear_attn`; keys and
        values shifted by ``window`` for ``linear_window``, so query ``t`` sees keys ``<= t - window``),
        the softmax terms over bands of ``2 * window`` keys."""
        vv = self._rep(v)
        if self.mixer in WINDOWED:
            num_w, den_w = window_terms(q, self._rep(k), vv, self.window, self.scaling)
            if self.mixer == "window":
                return num_w / den_w
        fq, fk = self._phi_q(q), self._phi_k(k)
        shift = self.window if self.mixer == "linear_window" else 0
        if shift:
            fk = F.pad(fk, (0, 0, shift, 0))[:, :, :fk.shape[2]]
            vv_lin = F.pad(vv, (0, 0, shift, 0))[:, :, :vv.shape[2]]
        else:
            vv_lin = vv
        # one dtype for the kernel: under CUDA autocast the feature maps leave softmax in float32, v in bfloat16
        kernel = fla_linear_attn() if fla else chunked_linear_attn
        num, _ = kernel(fq.transpose(1, 2).contiguous(), fk.transpose(1, 2).contiguous(),
                        vv_lin.to(fq.dtype).transpose(1, 2).contiguous(), scale=1.0, normalize=False)
        num = num.transpose(1, 2)
        den = (fq * fk.cumsum(2)).sum(-1, keepdim=True)
        if not shift:
            return num / den
        f = self._factor()
        return (f * num_w + (1 - f) * num) / (f * den_w + (1 - f) * den)

    def prefill(self, state: MixerState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fill an empty state with ``T`` tokens' keys and values (their outputs come from :meth:`parallel`)."""
        n = k.shape[2]
        if self.mixer == "softmax":
            state.k, state.v = k, v
        if self.mixer in WINDOWED:
            state.k = k.new_zeros(k.shape[0], k.shape[1], self.window, k.shape[3])
            state.v = torch.zeros_like(state.k)
            for p in range(max(0, n - self.window), n):
                state.k[:, :, p % self.window], state.v[:, :, p % self.window] = k[:, :, p], v[:, :, p]
        if self.mixer in FEATURED:
            gone = n if self.mixer == "linear" else max(0, n - self.window)  # tokens outside the window
            fk = self._phi_k(k[:, :, :gone])
            state.s = fk.transpose(-1, -2) @ self._rep(v[:, :, :gone])
            state.z = fk.sum(2)
        state.seen = n

    def step(self, state: MixerState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One token at position ``state.seen``: ``q`` ``[B, H, 1, d]``, ``k``/``v`` ``[B, kv_heads, 1, d]``
        -> ``[B, H, 1, d]``; updates ``state`` in place (its size does not change except for softmax)."""
        p = state.seen
        state.seen += 1
        if self.mixer == "softmax":
            state.k, state.v = torch.cat([state.k, k], 2), torch.cat([state.v, v], 2)
            return F.scaled_dot_product_attention(q, self._rep(state.k), self._rep(state.v), scale=self.scaling)
        if self.mixer == "linear":
            fq, fk = self._phi_q(q), self._phi_k(k)
            state.s = state.s + fk.transpose(-1, -2) @ self._rep(v)
            state.z = state.z + fk.sum(2)
            return (fq @ state.s) / (fq @ state.z.unsqueeze(-1))
        slot = p % self.window
        if self.mixer == "linear_window" and p >= self.window:  # the token leaving the window joins the linear state
            old_k, old_v = state.k[:, :, slot:slot + 1], state.v[:, :, slot:slot + 1]
            fk = self._phi_k(old_k)
            state.s = state.s + fk.transpose(-1, -2) @ self._rep(old_v)
            state.z = state.z + fk.sum(2)
        state.k[:, :, slot], state.v[:, :, slot] = k[:, :, 0], v[:, :, 0]
        filled = min(p + 1, self.window)
        keys, vals = self._rep(state.k[:, :, :filled]), self._rep(state.v[:, :, :filled])
        s = q @ keys.transpose(-1, -2) * self.scaling
        if self.mixer == "window":
            return torch.softmax(s, -1) @ vals
        a = torch.exp(s - s.amax(-1, keepdim=True))
        fq, f = self._phi_q(q), self._factor()
        return (f * (a @ vals) + (1 - f) * (fq @ state.s)) / (f * a.sum(-1, keepdim=True) + (1 - f) * (fq @ state.z.unsqueeze(-1)))


class ZGConvertedLlamaConfig(LlamaConfig):
    """``LlamaConfig`` plus per-layer lists.

    Attributes:
        layer_mixers: each layer's mixer (one of :data:`MIXERS`; None: softmax everywhere).
        mixer_window: tokens in the window of ``window`` / ``linear_window`` layers.
        layer_intermediate_sizes: MLP width of each layer (None: ``intermediate_size`` everywhere).
        layer_kv_heads: key-value heads of each layer (None: ``num_key_value_heads`` everywhere).
    """

    model_type = "zg_converted_llama"
    layer_mixers: list[str] | None = None
    mixer_window: int = 64
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

    def mixer(self, i: int) -> str:
        """Layer ``i``'s mixer."""
        return self.layer_mixers[i] if self.layer_mixers is not None else "softmax"


class ZGConvertedLlamaForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` whose layer ``i`` mixes tokens with ``config.mixer(i)``. Input
    ``[batch, seq]`` int64 ids, logits ``[batch, seq, vocab]``. Without a cache every mixer runs its
    parallel form; ``generate()`` (or ``use_cache=True``) runs on a :class:`ZGRecurrentCache`."""

    config_class = ZGConvertedLlamaConfig

    def __init__(self, config: ZGConvertedLlamaConfig):
        super().__init__(config)
        for i in range(config.num_hidden_layers):
            lc = config.layer_config(i)
            layer = LlamaDecoderLayer(lc, i)
            if hasattr(layer.mlp, "config"):
                layer.mlp.config = config
            layer.self_attn = ZGMixer(lc, i, config.mixer(i), config.mixer_window)
            self.model.layers[i] = layer
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own recurrent state

    def prepare_inputs_for_generation(self, input_ids, cache=None, past_key_values=None, attention_mask=None,
                                      **kwargs):
        """The tokens the state has not consumed yet, the state (a new one on the first step), and the
        attention mask (so a padded batch fails in :meth:`forward` as a direct call does)."""
        cache = cache if cache is not None else past_key_values
        if cache is None:
            cache = ZGRecurrentCache(self.config.num_hidden_layers)
        return {"input_ids": input_ids[:, cache.get_seq_length():], "cache": cache, "use_cache": True,
                "attention_mask": attention_mask}

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, past_key_values=None, **kwargs):
        """Logits ``[B, T, vocab]`` of ``input_ids`` ``[B, T]`` (positions continue the cache's);
        ``loss`` with ``labels``; ``cache``: the :class:`ZGRecurrentCache` after these tokens (when
        one was given or ``use_cache``). Raises ``ValueError`` for a padding mask."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("a converted student takes unpadded sequences only (attention_mask has zeros)")
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache:
            cache = ZGRecurrentCache(self.config.num_hidden_layers)
        h = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if position_ids is None:
            start = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(start, start + h.shape[1], device=h.device)[None]
        pe = self.model.rotary_emb(h, position_ids=position_ids)
        for layer in self.model.layers:
            h = layer(h, position_embeddings=pe, position_ids=position_ids, cache=cache)
        h = self.model.norm(h)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) and logits_to_keep else slice(None)
        logits = self.lm_head(h[:, keep])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)


ZGConvertedLlamaConfig.register_for_auto_class()
ZGConvertedLlamaForCausalLM.register_for_auto_class("AutoModelForCausalLM")
