"""One adapter per decoder family: where the decoder stack, embedding, final norm and LM head
live, how to build a student block from teacher layers, and how to stitch blocks back together.

Boundaries are the raw residual stream between decoder layers, captured with hooks on the
layers themselves (HF ``output_hidden_states`` applies the final norm to its last entry).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from .config import ConfigError


@dataclass(frozen=True)
class FamilyAdapter:
    """Names of a family's parts inside ``AutoModelForCausalLM`` / ``AutoModel``.

    Attributes:
        base: attribute of the causal LM holding the base model (``model`` / ``transformer``).
        layers: attribute of the base model holding the decoder ``ModuleList``.
        norm: attribute of the base model holding the final norm.
        n_layers_key: config key of the layer count.
    """

    base: str
    layers: str
    norm: str
    n_layers_key: str

    def base_model(self, lm: nn.Module) -> nn.Module:
        """The base (headless) model of a causal LM."""
        return getattr(lm, self.base)

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        """The decoder layers of a causal LM or a base model."""
        base = getattr(model, self.base, model)
        return getattr(base, self.layers)

    def layer_prefix(self) -> str:
        """State-dict prefix of decoder layer weights in the causal LM (e.g. ``model.layers.``)."""
        return f"{self.base}.{self.layers}."

    def sub_config(self, config, layer_indices: Sequence[int], headless: bool):
        """A copy of the teacher ``config`` for a stack of the given teacher layers.

        ``headless`` shrinks the vocabulary to one token (a block needs no embedding) and turns
        every dropout off.
        """
        cfg = copy.deepcopy(config)
        setattr(cfg, self.n_layers_key, len(layer_indices))
        if getattr(cfg, "layer_types", None) is not None:
            cfg.layer_types = [config.layer_types[i] for i in layer_indices]
        if headless:
            cfg.vocab_size = 1
            cfg.pad_token_id = None
            cfg.tie_word_embeddings = False
            for k in ("attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout"):
                if hasattr(cfg, k):
                    setattr(cfg, k, 0.0)
        if getattr(cfg, "quantization_config", None) is not None:
            del cfg.quantization_config
        return cfg


ADAPTERS = {
    "llama": FamilyAdapter("model", "layers", "norm", "num_hidden_layers"),
    "qwen2": FamilyAdapter("model", "layers", "norm", "num_hidden_layers"),
    "gpt2": FamilyAdapter("transformer", "h", "ln_f", "n_layer"),
}


def adapter_for(model_or_config) -> FamilyAdapter:
    """The adapter of a model or config. Raises :class:`ConfigError` for unsupported families."""
    cfg = getattr(model_or_config, "config", model_or_config)
    try:
        return ADAPTERS[cfg.model_type]
    except KeyError:
        raise ConfigError(f"unsupported architecture {cfg.model_type!r}; supported: {', '.join(ADAPTERS)}") from None


class StudentBlock(nn.Module):
    """A student block: a stack of decoder layers mapping residual stream to residual stream.

    ``forward(h)`` takes ``h`` of shape ``[batch, seq, hidden]`` (float32) — the residual stream at
    boundary i — and returns the residual stream at boundary i+1, same shape and dtype, with
    positions ``0..seq-1`` and a causal mask. It wraps the family's own HF base model (so rotary
    embeddings, masks and attention are transformers' code) with its embedding shrunk to one
    token, positional embedding zeroed and frozen (GPT-2), and its final norm removed.

    Args:
        teacher_config: the teacher's HF config.
        layer_indices: which teacher layers this block's layers correspond to (for per-layer
            config such as ``layer_types``); the block has ``len(layer_indices)`` layers.
    """

    def __init__(self, teacher_config, layer_indices: Sequence[int]):
        super().__init__()
        from transformers import AutoModel

        self.adapter = adapter_for(teacher_config)
        cfg = self.adapter.sub_config(teacher_config, layer_indices, headless=True)
        self.body = AutoModel.from_config(cfg, attn_implementation="sdpa")
        setattr(self.body, self.adapter.norm, nn.Identity())
        if hasattr(self.body, "wpe"):
            nn.init.zeros_(self.body.wpe.weight)
            self.body.wpe.weight.requires_grad_(False)
        for p in self.body.get_input_embeddings().parameters():
            p.requires_grad_(False)
        for j, layer in enumerate(self.layers):
            _set_layer_idx(layer, j)

    @property
    def layers(self) -> nn.ModuleList:
        """The block's decoder layers."""
        return getattr(self.body, self.adapter.layers)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.body(inputs_embeds=h, use_cache=False).last_hidden_state

    def layer_state_dict(self) -> dict[str, torch.Tensor]:
        """Trainable weights only, keyed ``layers.<j>.<name>`` (contiguous tensors)."""
        return {f"layers.{k}": v.detach().contiguous() for k, v in self.layers.state_dict().items()}

    def load_layer_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load weights saved by :meth:`layer_state_dict`. Raises on missing/unexpected keys."""
        self.layers.load_state_dict({k[len("layers."):]: v for k, v in sd.items()}, strict=True)


def _set_layer_idx(layer: nn.Module, j: int) -> None:
    for mod in layer.modules():
        if hasattr(mod, "layer_idx"):
            mod.layer_idx = j


def build_block(teacher: nn.Module, layer_indices: Sequence[int], init: str, seed: int) -> StudentBlock:
    """Build a student block over teacher layers ``layer_indices``.

    ``init="teacher"`` copies those teacher layers' weights; ``"random"`` keeps the family's own
    random initialisation drawn with ``seed``. Returns a float32 block in train mode on the
    teacher's device.
    """
    torch.manual_seed(seed)
    block = StudentBlock(teacher.config, layer_indices)
    if init == "teacher":
        src = adapter_for(teacher).decoder_layers(teacher)
        for j, i in enumerate(layer_indices):
            block.layers[j].load_state_dict(src[i].state_dict())
    device = next(teacher.parameters()).device
    return block.to(device)


@torch.no_grad()
def capture_boundaries(teacher: nn.Module, input_ids: torch.Tensor, boundaries: Sequence[int]) -> dict[int, torch.Tensor]:
    """Run the frozen teacher and return the raw residual stream at each boundary.

    Args:
        teacher: a causal LM of a supported family.
        input_ids: ``[batch, seq]`` int64 token ids.
        boundaries: layer indices; ``b`` means the input of layer ``b`` (``b = n_layers``: the
            output of the last layer, before the final norm).

    Returns:
        ``{b: tensor[batch, seq, hidden] float32}``. Only layers up to ``max(boundaries)`` run;
        the final norm and LM head never do.
    """
    ad = adapter_for(teacher)
    layers = ad.decoder_layers(teacher)
    out: dict[int, torch.Tensor] = {}
    hooks = []
    last = max(boundaries)

    class _Stop(Exception):
        pass

    def pre_hook(_m, args, kwargs):
        out[0] = (args[0] if args else kwargs["hidden_states"]).detach().float().clone()
        if last == 0:
            raise _Stop

    def make_hook(b):
        def hook(_m, _args, output):
            out[b] = (output[0] if isinstance(output, tuple) else output).detach().float().clone()
            if b == last:
                raise _Stop
        return hook

    if 0 in boundaries:
        hooks.append(layers[0].register_forward_pre_hook(pre_hook, with_kwargs=True))
    for b in boundaries:
        if b > 0:
            hooks.append(layers[b - 1].register_forward_hook(make_hook(b)))
    from .device import autocast

    try:
        with autocast(input_ids.device):
            ad.base_model(teacher)(input_ids=input_ids, use_cache=False)
    except _Stop:
        pass
    finally:
        for h in hooks:
            h.remove()
    return {b: out[b] for b in boundaries}


def head_logits(teacher: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Teacher's final norm then LM head on residual stream ``h`` ``[B, T, H]`` → logits ``[B, T, V]``."""
    ad = adapter_for(teacher)
    return teacher.get_output_embeddings()(getattr(ad.base_model(teacher), ad.norm)(h))


def head_only(teacher: nn.Module) -> nn.Module:
    """The teacher with its decoder layers removed and every weight frozen, in place: what
    :func:`head_logits` needs (final norm and LM head; the embedding stays when tied to the head).
    Frees the layers' memory once nothing else refers to them. Returns ``teacher``."""
    base = adapter_for(teacher).base_model(teacher)
    setattr(base, adapter_for(teacher).layers, nn.ModuleList())
    return teacher.requires_grad_(False)


def assemble(teacher: nn.Module, blocks: Sequence[StudentBlock]) -> nn.Module:
    """Stitch the teacher's embedding, ``blocks`` in order, and its final norm and LM head into one
    causal LM of the teacher's family (a fresh module; the teacher is not modified).

    Returns a float32 ``AutoModelForCausalLM`` in eval mode with ``sum(len(block.layers))`` layers.
    """
    from transformers import AutoModelForCausalLM

    ad = adapter_for(teacher)
    total = sum(len(b.layers) for b in blocks)
    layer_types = []
    for b in blocks:
        lt = getattr(b.body.config, "layer_types", None)
        layer_types += list(lt) if lt is not None else []
    cfg = ad.sub_config(teacher.config, range(total), headless=False)
    if layer_types:
        cfg.layer_types = layer_types
    with torch.device("meta"):
        student = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    prefix = ad.layer_prefix()
    sd = {k: v for k, v in teacher.state_dict().items() if not k.startswith(prefix)}
    offset = 0
    for b in blocks:
        for k, v in b.layers.state_dict().items():
            j, rest = k.split(".", 1)
            sd[f"{prefix}{offset + int(j)}.{rest}"] = v.detach().clone()
        offset += len(b.layers)
    student.load_state_dict(sd, strict=False, assign=True)
    missing = [n for n, p in student.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"assembled student has unfilled parameters: {missing[:5]}")
    if cfg.tie_word_embeddings:
        student.tie_weights()
    # Non-persistent buffers (rotary inv_freq, GPT-2 masks) were created on meta; rebuild them.
    _materialise_buffers(student, teacher)
    return student.eval()


def _materialise_buffers(student: nn.Module, teacher: nn.Module) -> None:
    tbufs = dict(teacher.named_buffers())
    for name, buf in list(student.named_buffers()):
        if buf.is_meta:
            mod_name, _, attr = name.rpartition(".")
            mod = student.get_submodule(mod_name)
            src = tbufs.get(name)
            if src is None:  # a per-layer buffer under a renumbered layer: take any layer's twin
                generic = [n for n in tbufs if n.split(".")[-1] == attr and n.endswith(name.split(".", 3)[-1])]
                src = tbufs[generic[0]] if generic else None
            if src is None:
                raise RuntimeError(f"cannot materialise buffer {name}")
            mod.register_buffer(attr, src.detach().clone(), persistent=name in student.state_dict())
