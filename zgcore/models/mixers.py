"""Token mixers of student blocks (``train.mixer``): which families can take them, how a teacher
layer's attention becomes one, and the one-line checks of a configuration that asks for them.

The mixers themselves, both forms (parallel and recurrent), live in
:mod:`zgcore.models.hf_converted_llama`, the file an exported converted student carries, so the
trained block and the exported model run the same code. This module names them without importing
that file (torch and transformers load only where a model runs, not where a configuration is
checked): :data:`MIXERS`, :data:`WINDOWED` and :data:`FEATURED` equal the exported file's own, which
it must declare itself to load alone (``tests/test_startup_and_clean.py`` holds the two equal).
``softmax`` keeps the family's own HF attention untouched (today's students, byte for byte); every other mixer replaces a layer's
``self_attn`` by a :class:`~zgcore.models.hf_converted_llama.ZGMixer` that starts from the teacher's
``q/k/v/o`` projections and rotary positions.

Sources: LoLCATs (Zhang et al. 2024, arXiv:2410.10254), Hedgehog (Zhang et al. 2024,
arXiv:2402.04347), Puzzle (Bercovich et al. 2024, arXiv:2411.19146).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any
from collections.abc import Mapping

from zgcore.checks import ConfigError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["MIXERS", "WINDOWED", "FEATURED", "FAMILIES", "convert_layer", "own_keys", "check_family",
           "check_window", "layer_mixers", "is_converted"]

DEFAULT = "softmax"
MIXERS = ("softmax", "window", "linear", "linear_window", "none")
WINDOWED = ("window", "linear_window")  # mixers that read the window
FEATURED = ("linear", "linear_window")  # mixers with a learned feature map
# families whose attention a ZGMixer reproduces (q/k/v/o projections, rotary, 1/sqrt(d) scaling, no
# q/k norm, no soft-capping) and whose converted student the exported modelling code builds
FAMILIES: dict[str, tuple[str, ...]] = {m: ("llama",) for m in MIXERS if m != DEFAULT}


def convert_layer(layer: nn.Module, config, mixer: str, window: int, layer_idx: int) -> None:
    """Replace decoder ``layer``'s attention by a ``mixer`` in place, keeping its projections
    (the teacher's, when the layer holds them). ``softmax`` leaves the layer untouched.

    Raises:
        ValueError: an unknown mixer or a window < 1 for a windowed one.
    """
    if mixer == DEFAULT:
        return
    from zgcore.models.hf_converted_llama import ZGMixer

    new = ZGMixer(config, layer_idx, mixer, window)
    old = layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if hasattr(new, name):
            setattr(new, name, getattr(old, name))
    layer.self_attn = new


def own_keys(layer_state: Mapping[str, Any]) -> set[str]:
    """The keys of a converted layer's state dict that no teacher layer has (the feature maps and
    linear_window's window factor)."""
    return {k for k in layer_state if k.rsplit(".", 1)[-1] in ("feature_q", "feature_k", "window_factor")}


def is_converted(t: Mapping[str, Any]) -> bool:
    """Whether block train settings ``t`` ask for a mixer other than the teacher's attention."""
    return t.get("mixer", DEFAULT) != DEFAULT


def check_family(mixers: Mapping[str, str], model_type: str) -> None:
    """``mixers``: ``{where: mixer}`` (e.g. ``{"blocks.1.mixer": "linear"}``). Raises :class:`ConfigError`
    naming the families that can take a mixer when ``model_type`` cannot."""
    for where, m in mixers.items():
        if m != DEFAULT and model_type not in FAMILIES.get(m, ()):
            raise ConfigError(f"{where}={m!r}: the {model_type!r} family cannot take this mixer; families that can: "
                              f"{', '.join(FAMILIES[m])} (or use mixer=softmax)")


def check_window(where: str, mixer: str, window: int, seq_len: int) -> None:
    """A windowed mixer's window must be shorter than the sequence. Raises :class:`ConfigError`."""
    if mixer in WINDOWED and int(window) >= int(seq_len):
        raise ConfigError(f"{where}={window} is as long as the sequence (corpus.seq_len={seq_len}): mixer {mixer!r} "
                          f"would see every token; set a window below {seq_len} or use mixer=softmax")


def layer_mixers(blocks) -> list[str]:
    """Each layer's mixer, in order, over student blocks (:class:`~zgcore.models.adapters.StudentBlock`)."""
    return [b.mixer for b in blocks for _ in b.layers]
