"""Student blocks over teacher layers, boundary capture, the teacher's whole head, and assembly
of blocks into one causal LM — for every family in :mod:`zgcore.models.families`.

Boundaries are the raw residual stream between decoder layers, captured with hooks on the
layers themselves (HF ``output_hidden_states`` applies the final norm to its last entry).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from zgcore.models.channels import mlp_width, pad_layer, prune_layer, top_channels
from zgcore.models import mixers
from zgcore.models.families import ADAPTERS, FamilyAdapter, adapter_for, attn_implementation  # noqa: F401 (re-exported)


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
        intermediate_size: the MLP width of the block's layers (None: the teacher's).
        kv_heads: key-value heads of the block's attention (None: the teacher's;
            :mod:`zgcore.models.heads`).
        mixer: the token mixer of every layer (:mod:`zgcore.models.mixers`; ``softmax``: the family's
            own attention). window: tokens in a windowed mixer's window.
    """

    def __init__(self, teacher_config, layer_indices: Sequence[int], intermediate_size: int | None = None,
                 kv_heads: int | None = None, mixer: str = "softmax", window: int | None = None):
        super().__init__()
        from transformers import AutoModel

        self.adapter = adapter_for(teacher_config)
        cfg = self.adapter.sub_config(teacher_config, layer_indices, headless=True)
        self.width = int(intermediate_size or mlp_width(teacher_config))
        setattr(cfg, self.adapter.width_key, self.width)
        if kv_heads is not None:
            cfg.num_key_value_heads = int(kv_heads)
        self.kv_heads = kv_heads
        self.body = AutoModel.from_config(cfg, attn_implementation=attn_implementation(cfg), dtype=torch.float32)
        setattr(self.body, self.adapter.norm, nn.Identity())
        if hasattr(self.body, "wpe"):
            nn.init.zeros_(self.body.wpe.weight)
            self.body.wpe.weight.requires_grad_(False)
        for p in self.body.get_input_embeddings().parameters():
            p.requires_grad_(False)
        for j, layer in enumerate(self.layers):
            _set_layer_idx(layer, j)
        self.mixer, self.window = mixer, window
        for j, layer in enumerate(self.layers):
            mixers.convert_layer(layer, cfg, mixer, int(window or 0), j)

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


def build_block(teacher, layer_indices: Sequence[int], init: str, seed: int, *,
                device: torch.device | str | None = None, intermediate_size: int | None = None,
                channels: Sequence[Sequence[float]] | None = None, kv_heads: int | None = None,
                mixer: str = "softmax", window: int | None = None) -> StudentBlock:
    """Build a student block over teacher layers ``layer_indices``.

    Args:
        teacher: the teacher as a causal LM (``nn.Module``), or a lazy layer source — anything
            with ``config`` and ``layer_weights(i) -> {name: tensor}`` (teacher layer ``i``'s
            weights keyed as in the layer's ``state_dict``), e.g.
            :class:`zgcore.models.teacher_weights.LazyLayers`, which reads only the requested layers.
        init: ``"teacher"`` copies those teacher layers' weights; ``"random"`` keeps the
            family's own random initialisation drawn with ``seed``.
        device: where the block goes (default: the teacher's device).
        intermediate_size: an MLP width narrower than the teacher's; with ``init="teacher"`` each
            layer keeps its channels of largest mean |activation| (``channels[i]``: teacher layer
            i's per-channel magnitudes, :func:`zgcore.models.students.measure`).
        kv_heads: fewer key-value heads than the teacher's; with ``init="teacher"`` each group's
            key and value heads start as the mean of the teacher's (:func:`zgcore.models.heads.group_kv`).
        mixer, window: the layers' token mixer (:mod:`zgcore.models.mixers`); with ``init="teacher"`` it
            starts from the teacher's projections, its feature maps from the identity.

    Returns a float32 block in train mode.

    Raises:
        KeyError: a source lacks a layer's weight.
        ValueError: a narrower teacher-initialised block without ``channels``.
    """
    torch.manual_seed(seed)
    block = StudentBlock(teacher.config, layer_indices, intermediate_size, kv_heads, mixer, window)
    if init == "teacher":
        from zgcore.models.heads import group_kv

        weights = teacher.layer_weights if hasattr(teacher, "layer_weights") else module_layer_weights(teacher)
        narrow = intermediate_size is not None and block.width != mlp_width(teacher.config)
        if narrow and channels is None:
            raise ValueError("a narrower teacher-initialised block needs the teacher's channel magnitudes")
        for j, i in enumerate(layer_indices):
            want = block.layers[j].state_dict()
            got = weights(i)
            own = mixers.own_keys(want)  # a converted mixer's feature maps keep their initialisation
            missing = sorted(set(want) - set(got) - own)
            if missing:
                raise KeyError(f"teacher layer {i} has no weights for {missing[:3]}")
            sd = {k: got[k] for k in want if k not in own}
            if kv_heads is not None:
                sd = group_kv(sd, teacher.config, int(kv_heads))
            sd = prune_layer(sd, teacher.config, top_channels(channels[i], block.width)) if narrow else sd
            block.layers[j].load_state_dict({**sd, **{k: want[k] for k in own}})
    if device is None:
        device = teacher.device if not isinstance(teacher, nn.Module) else next(teacher.parameters()).device
    return block.to(device)


def module_layer_weights(teacher: nn.Module):
    """``i -> state_dict of decoder layer i`` of a loaded teacher (the in-memory layer source)."""
    layers = adapter_for(teacher).decoder_layers(teacher)
    return lambda i: layers[i].state_dict()


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

    The teacher runs one sequence at a time, so a sequence's boundaries are the same bits whichever
    batch it comes in: a matrix product's rounding may depend on how many rows it has (MKL's AVX2
    kernels do; its AVX-512 ones here did not, which hid it), and the cache build's batches are not
    training's. That is what makes cached and online targets bitwise identical on any machine, as
    :func:`zgcore.data.logit_store.online_targets` does for the top-k logits. A streamed teacher
    (:class:`zgcore.models.teacher_stream.StreamedTeacher`) answers with its own, equal, capture.
    """
    if hasattr(teacher, "capture"):
        return teacher.capture(input_ids, boundaries)
    if input_ids.shape[0] > 1:
        first = capture_boundaries(teacher, input_ids[:1], boundaries)
        out = {b: h.new_empty((input_ids.shape[0], *h.shape[1:])) for b, h in first.items()}  # filled row by row
        for i in range(input_ids.shape[0]):
            for b, h in (first if i == 0 else capture_boundaries(teacher, input_ids[i: i + 1], boundaries)).items():
                out[b][i] = h[0]
        return out
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
    from zgcore.device import autocast

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
    """The teacher's whole head on residual stream ``h`` ``[B, T, H]`` → logits ``[B, T, V]``: final
    norm, LM head, then what the family's causal LM does after the head (Granite's logit scaling,
    Gemma's final-logit soft-capping), so cross-entropy on these logits is the teacher's own."""
    ad = adapter_for(teacher)
    logits = teacher.get_output_embeddings()(getattr(ad.base_model(teacher), ad.norm)(h))
    return ad.finish_logits(teacher.config, logits)


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

    Blocks of different MLP widths: the config carries the widest, and narrower blocks' layers
    get zero channels appended (:func:`zgcore.models.channels.pad_layer`), which computes exactly the same
    function (HF configs have one ``intermediate_size`` for all layers).

    Blocks with fewer key-value heads (``kv_heads``) must all have the same count, which the config
    carries; students whose layers differ in KV heads are :func:`zgcore.models.hetero.assemble_exact`'s.

    Returns a float32 ``AutoModelForCausalLM`` in eval mode with ``sum(len(block.layers))`` layers.

    Raises:
        ValueError: blocks of different ``kv_heads``.
    """
    from transformers import AutoModelForCausalLM

    ad = adapter_for(teacher)
    kvs = {b.kv_heads for b in blocks}
    if len(kvs) > 1:
        raise ValueError(f"blocks with different kv_heads ({sorted(map(str, kvs))}) cannot share one config; "
                         "give every block one train.kv_heads (SelectStudent assembles layers of their own shapes)")
    width = max(b.width for b in blocks)
    total = sum(len(b.layers) for b in blocks)
    layer_types = []
    for b in blocks:
        lt = getattr(b.body.config, "layer_types", None)
        layer_types += list(lt) if lt is not None else []
    cfg = ad.sub_config(teacher.config, range(total), headless=False)
    if width != mlp_width(teacher.config):
        setattr(cfg, ad.width_key, width)
    if blocks[0].kv_heads is not None:
        cfg.num_key_value_heads = int(blocks[0].kv_heads)
    if layer_types:
        cfg.layer_types = layer_types
    with torch.device("meta"):
        student = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation(cfg), dtype=torch.float32)
    def padded(b: StudentBlock, lsd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return pad_layer(lsd, teacher.config, b.width, width) if b.width < width else lsd

    return fill_student(student, teacher, blocks, padded).eval()


def fill_student(student: nn.Module, teacher: nn.Module, blocks: Sequence[StudentBlock],
                 layer_state: Callable[[StudentBlock, dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> nn.Module:
    """Fill a student built on the meta device: the teacher's weights outside its decoder layers
    (embedding, final norm, LM head), then every block's layers in order, renumbered from 0;
    ``layer_state(block, state_dict)`` may reshape a layer's tensors first (e.g. zero-pad an MLP).
    Ties the word embeddings where the config says so and rebuilds non-persistent buffers (rotary
    ``inv_freq``, GPT-2 masks) that were created on meta. Returns ``student`` (its tensors' dtypes
    as loaded). Raises ``RuntimeError`` when a parameter is left unfilled."""
    prefix = adapter_for(teacher).layer_prefix()
    sd = {k: v for k, v in teacher.state_dict().items() if not k.startswith(prefix)}
    offset = 0
    for b in blocks:
        for j, layer in enumerate(b.layers):
            lsd = layer.state_dict()
            for k, v in (layer_state(b, lsd) if layer_state else lsd).items():
                sd[f"{prefix}{offset + j}.{k}"] = v.detach().clone()
        offset += len(b.layers)
    student.load_state_dict(sd, strict=False, assign=True)
    missing = [n for n, p in student.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"assembled student has unfilled parameters: {missing[:5]}")
    if student.config.tie_word_embeddings:
        student.tie_weights()
    _materialise_buffers(student, teacher)
    return student


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
