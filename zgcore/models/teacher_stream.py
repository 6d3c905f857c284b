"""The layer-streamed teacher: a teacher run layer by layer over a set of sequences, so that no task
holds more than one of its decoder layers.

:class:`StreamedTeacher` holds the teacher's embedding (and, for scoring, its final norm and LM
head) and reads one decoder layer at a time from the teacher's safetensors files
(:class:`~zgcore.models.teacher_weights.LazyLayers`, ``safetensors.safe_open``). Given the batches
a task will run (:meth:`StreamedTeacher.precompute`) it applies layer ``l`` to every batch before it
reads layer ``l + 1``, records the boundaries asked for, frees the layer, and keeps the last
layer's output: the weights are read once per shard. Afterwards it answers as the whole teacher
does (``capture_boundaries``, ``model(input_ids=...).logits``) from what it computed; a batch it was
not given is streamed on its own.

Each layer runs in a one-layer copy of the family's own base model (its embedding shrunk to one
token, its final norm removed, the multipliers the base model applies to ``inputs_embeds``
neutral: :meth:`~zgcore.models.families.FamilyAdapter.sub_config` with ``headless``), fed the
residual stream as ``inputs_embeds``: the same layer code, rotary embeddings and masks on the same
batch as the whole teacher's forward, so the result is the same bytes (tests/test_teacher_stream.py).

:func:`plan` decides between the whole teacher and the streamed one (``teacher_stream``: ``auto``
streams when the whole teacher's planned peak does not fit the device's free memory) and fails
before any work when even one layer does not fit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from zgcore.checks import ConfigError
from zgcore.models.families import adapter_for, attn_implementation

MODES = ("auto", "true", "false")
ENV = "ZG_TEACHER_STREAM"  # the experiment's teacher_stream, as the workflow that loaded it set it for its tasks


def mode() -> str:
    """The ``teacher_stream`` setting in force: ``auto`` (default), ``true`` or ``false`` (from :data:`ENV`)."""
    v = os.environ.get(ENV, "auto").strip().lower()
    return {"1": "true", "0": "false"}.get(v, v) if v in MODES + ("1", "0") else "auto"


def free_memory(device: torch.device | str) -> int:
    """Bytes free for a task on ``device``: CUDA's free device memory, else the host's available
    memory (bounded by the cgroup's ``memory.max`` less its use, where one is set)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    import psutil

    free = int(psutil.virtual_memory().available)
    try:
        from pathlib import Path

        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return free


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def plan(
    record: Mapping[str, Any],
    n_layers: int,
    dtype: str,
    device: str,
    head: bool,
    activations: int = 0,
    setting: str | None = None,
    free: int | None = None,
) -> bool:
    """Whether to stream the teacher's first ``n_layers`` layers in ``dtype`` on ``device``.

    ``setting`` (default :func:`mode`): ``false`` never streams, ``true`` always (where the teacher's
    weights are local safetensors), ``auto`` when the whole teacher's planned peak (its layers up to
    ``n_layers``, its other weights, ``activations`` bytes) exceeds ``free`` (default :func:`free_memory`).

    Raises:
        ConfigError: streaming is needed or asked for, and the largest layer plus the other weights
            and activations exceed the free memory (naming the layer's size and the free memory), or
            ``true`` for a teacher whose weights are no local safetensors.
    """
    from zgcore.models.teacher_weights import LazyLayers, has_safetensors

    setting = setting or mode()
    if setting == "false":
        return False
    if not has_safetensors(record):
        if setting == "true":
            raise ConfigError(
                f"teacher_stream = true needs the teacher's weights as local safetensors; {record['path']} "
                "has none (save it with save_pretrained, or set teacher_stream = auto)"
            )
        return False
    src = LazyLayers(record)
    item = torch.empty(0, dtype=_dtype(dtype)).element_size()
    layers = [src.layer_numel(i) * item for i in range(n_layers)]
    other = src.other_numel(head) * item
    free = free_memory(device) if free is None else int(free)
    if setting == "auto" and sum(layers) + other + activations <= free:
        return False
    big = max(range(n_layers), key=layers.__getitem__)
    if layers[big] + other + activations > free:
        raise ConfigError(
            f"teacher layer {big} needs {_gib(layers[big])} in {dtype} (with the embedding and head "
            f"{_gib(other)} and activations {_gib(activations)}), more than the {_gib(free)} free on "
            f"{device} even streamed layer by layer: use a device with more memory or a smaller teacher_dtype"
        )
    return True


def _dtype(name: str) -> torch.dtype:
    from zgcore.device import torch_dtype

    return torch_dtype(name)


class _Stop(Exception):
    pass


def _key(ids: torch.Tensor) -> tuple:
    return tuple(ids.shape), ids.cpu().numpy().tobytes()


class StreamedTeacher(nn.Module):
    """The teacher's first ``n_layers`` decoder layers, streamed one layer at a time.

    Args:
        record: a teacher record whose weights are local safetensors
            (:func:`~zgcore.models.teacher_weights.has_safetensors`).
        n_layers: layers it runs (default: all). dtype: the layers' dtype (the whole teacher's
            ``load_base`` / ``load`` dtype). device: where it computes.
        head: hold the final norm and LM head too (logits; as :func:`zgcore.models.teacher.load`).

    Attributes:
        config: the teacher's HF config (all layers). shell: the teacher without decoder layers
            (embedding; with ``head`` the final norm and LM head). layer_reads: decoder layers read so far.
    """

    def __init__(
        self,
        record: Mapping[str, Any],
        n_layers: int | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        head: bool = False,
    ):
        super().__init__()
        from zgcore.device import resolve
        from zgcore.models.teacher_weights import LazyLayers

        self.src = LazyLayers(record)
        self.config = self.src.config
        self.adapter = adapter_for(self.config)
        self.n_layers = int(n_layers or self.config.num_hidden_layers)
        self.dtype, self.dev = _dtype(dtype), resolve(device)
        self.shell = self._shell(head)
        self.layer_reads = 0
        self._caps: dict[tuple, dict[int, torch.Tensor]] = {}
        self._final: dict[tuple, torch.Tensor] = {}
        self._pending = None

    def _empty(self, cls, cfg) -> nn.Module:
        from accelerate import init_empty_weights

        with init_empty_weights():  # parameters on meta, buffers (rotary frequencies) computed for real
            return cls.from_config(cfg, attn_implementation=attn_implementation(cfg), dtype=self.dtype)

    def _fill(self, model: nn.Module, sd: dict[str, torch.Tensor], unused: str | None = None) -> nn.Module:
        """``model`` (built on meta) with ``sd`` assigned, in the layers' dtype, on the device. A parameter
        left unfilled raises ``KeyError``, except, with ``unused`` (the prefix of a body's layers), one
        outside that prefix (the one-token embedding, GPT-2's positions): zeros, never read."""
        model.load_state_dict({k: v.to(self.dtype) for k, v in sd.items()}, strict=False, assign=True)
        if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
            model.tie_weights()
        for name, p in list(model.named_parameters()):
            if p.is_meta:  # a block's one-token embedding and GPT-2's zeroed positions: never read
                if unused is None or name.startswith(unused):
                    raise KeyError(f"{self.src.path}: the teacher's safetensors lack {name}")
                mod, _, attr = name.rpartition(".")
                setattr(model.get_submodule(mod), attr, nn.Parameter(torch.zeros(p.shape, dtype=p.dtype), False))
        return model.eval().requires_grad_(False).to(self.dev)

    def _shell(self, head: bool) -> nn.Module:
        from transformers import AutoModel, AutoModelForCausalLM

        cfg = self.adapter.sub_config(self.config, range(0), headless=False)
        if head:
            sd = self.src.other_weights()
            return self._fill(self._empty(AutoModelForCausalLM, cfg), sd)
        base = self.adapter.base + "."
        sd = {k[len(base) :]: v for k, v in self.src.other_weights(base_only=True).items()}
        return self._fill(self._empty(AutoModel, cfg), sd)

    @property
    def device(self) -> torch.device:
        """Where it computes."""
        return self.dev

    def layer(self, i: int) -> nn.Module:
        """Teacher layer ``i`` as a one-layer base model (``inputs_embeds`` in, raw residual out), read now."""
        from transformers import AutoModel

        ad = self.adapter
        body = self._empty(AutoModel, ad.sub_config(self.config, [i], headless=True))
        setattr(body, ad.norm, nn.Identity())
        sd = {f"{ad.layers}.0.{k}": v for k, v in self.src.layer_weights(i).items()}
        self.layer_reads += 1
        return self._fill(body, sd, unused=f"{ad.layers}.")

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Boundary 0 of ``ids`` ``[B, T]``: the stream layer 0 receives, in the layers' dtype."""
        out = {}

        def hook(_m, args, kwargs):
            out[0] = args[0] if args else kwargs["hidden_states"]
            raise _Stop

        base = self.adapter.base_model(self.shell)
        h = getattr(base, self.adapter.norm).register_forward_pre_hook(hook, with_kwargs=True)
        try:
            base(input_ids=ids.to(self.dev), use_cache=False)
        except _Stop:
            pass
        finally:
            h.remove()
        return out[0]

    @torch.no_grad()
    def run(
        self, batches: Sequence[torch.Tensor], boundaries: Sequence[int] = (), last: int | None = None, progress=None
    ) -> tuple[list[dict[int, torch.Tensor]], list[torch.Tensor]]:
        """Run layers ``0 .. last - 1`` (default all ``n_layers``) over ``batches`` (int64 ids ``[B, T]``
        each), layer by layer: each layer is read once and applied to every batch as it stands.

        Returns ``(captures, final)``: per batch ``{b: float32 [B, T, hidden]}`` for each of ``boundaries``
        (the raw residual stream at the input of layer ``b``) and the last layer's output in the layers'
        dtype (before the final norm). ``progress(l, last)`` is called after each layer."""
        from zgcore.device import autocast

        last = self.n_layers if last is None else int(last)
        want = {int(b) for b in boundaries}
        with autocast(self.dev):
            hs = [self.embed(ids) for ids in batches]
        caps = [{0: h.detach().float().clone()} if 0 in want else {} for h in hs]
        for i in range(last):
            body = self.layer(i)
            with autocast(self.dev):
                for j in range(len(hs)):
                    hs[j] = body(inputs_embeds=hs[j], use_cache=False).last_hidden_state
                    if i + 1 in want:
                        caps[j][i + 1] = hs[j].detach().float().clone()
            del body
            if progress:
                progress(i + 1, last)
        return caps, hs

    def precompute(
        self,
        batches: Sequence[torch.Tensor],
        boundaries: Sequence[int] = (),
        head: bool = False,
        progress=None,
        lazy: bool = False,
    ) -> None:
        """Run ``batches`` layer by layer (:meth:`run`: each layer read once), and keep their
        ``boundaries`` (for :meth:`capture`) or, with ``head``, their last layers' output (for
        :meth:`forward`), so that later calls on the same ids answer from here. Boundaries up to the
        largest asked run (without ``head``); with ``head`` every layer. ``lazy``: at the first
        :meth:`capture` or :meth:`forward` (inside the caller's timing), not now."""
        if lazy:
            self._pending = (batches, boundaries, head, progress)
            return
        last = None if head else max(boundaries)
        caps, final = self.run(batches, boundaries, last, progress)
        for ids, c, h in zip(batches, caps, final):
            if head:
                self._final[_key(ids)] = h
            else:
                self._caps[(_key(ids), tuple(sorted(set(boundaries))))] = c

    def _run_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.precompute(*pending)

    def clear(self) -> None:
        """Forget what :meth:`precompute` kept."""
        self._caps.clear()
        self._final.clear()

    def capture(self, ids: torch.Tensor, boundaries: Sequence[int]) -> dict[int, torch.Tensor]:
        """As :func:`zgcore.models.adapters.capture_boundaries`: the raw residual stream at each
        boundary, float32 ``[B, T, hidden]``, each sequence run on its own (batch 1)."""
        self._run_pending()
        bs = tuple(sorted({int(b) for b in boundaries}))
        rows = [ids[i : i + 1] for i in range(ids.shape[0])]
        got = [self._caps.get((_key(r), bs)) for r in rows]
        todo = [r for r, g in zip(rows, got) if g is None]
        if todo:
            fresh = iter(self.run(todo, bs, max(bs))[0])
            got = [g if g is not None else next(fresh) for g in got]
        return {b: torch.cat([g[b] for g in got]) for b in boundaries}

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The whole head on the last layer's output ``h``: final norm, LM head, the family's finish."""
        from zgcore.models.adapters import head_logits

        return head_logits(self.shell, h)

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False, output_hidden_states: bool = False, **_):
        """As the whole causal LM's forward on ``input_ids`` ``[B, T]`` (the batch as given): ``.logits``
        ``[B, T, V]``; with ``output_hidden_states`` also ``.hidden_states`` (the raw stream at each
        layer's input, then the normed last output, as transformers gives them)."""
        self._run_pending()
        key = _key(input_ids)
        if output_hidden_states:
            caps, final = self.run([input_ids], range(self.n_layers))
            hidden = tuple(caps[0][b].to(final[0].dtype) for b in range(self.n_layers))
            normed = getattr(self.adapter.base_model(self.shell), self.adapter.norm)(final[0])
            return SimpleNamespace(logits=self.logits(final[0]), hidden_states=hidden + (normed,))
        h = self._final.get(key)
        if h is None:
            h = self.run([input_ids])[1][0]
        return SimpleNamespace(logits=self.logits(h))

    def flop_parameters(self, head: bool) -> dict[str, Any]:
        """What :func:`zgcore.evaluation.flops.model_parameters` (``head``) or ``decoder_parameters``
        count of the whole teacher, from the safetensors' shapes (no weight read)."""
        out = {
            "layers": [self.src.layer_numel(i) for i in range(self.n_layers)],
            "width": int(self.config.get_text_config().hidden_size),
        }
        if head:
            out = {
                "layers": out["layers"],
                "head": int(self.shell.get_output_embeddings().weight.numel()),
                "width": out["width"],
            }
        return out


def teacher_for(
    record: Mapping[str, Any],
    n_layers: int | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    head: bool = False,
    activations: int = 0,
    setting: str | None = None,
):
    """The teacher as a task runs it over stored tokens: its first ``n_layers`` layers (default all) in
    ``dtype``, as :func:`~zgcore.models.teacher_weights.load_base` (``head`` False: the base model) or
    :func:`~zgcore.models.teacher.load` (``head`` True: the causal LM, float32) loads it whole, or a
    :class:`StreamedTeacher` of the same when :func:`plan` (``setting``, ``activations`` bytes) says so.

    Raises:
        ConfigError: as :func:`plan`, before any weight is read.
    """
    n = int(n_layers or record.get("n_layers") or 0) or None
    if n is None:
        from transformers import AutoConfig

        n = int(AutoConfig.from_pretrained(record["path"]).num_hidden_layers)
    if plan(record, n, dtype, device, head, activations, setting):
        return StreamedTeacher(record, n, dtype, device, head)
    if head:
        from zgcore.models.teacher import load

        return load(dict(record), device)[0]
    from zgcore.models.teacher_weights import load_base

    return load_base(record, n, dtype, device)


def activation_bytes(sequences: int, seq_len: int, hidden: int, dtype: str, kept: int) -> int:
    """Bytes a streamed run holds for ``sequences`` of ``seq_len`` tokens: the stream in ``dtype`` plus
    ``kept`` float32 copies of it (boundaries or outputs kept for later)."""
    item = torch.empty(0, dtype=_dtype(dtype)).element_size()
    return int(sequences) * int(seq_len) * int(hidden) * (item + 4 * int(kept))
