"""The devices a plan (:mod:`zgcore.evaluation.plan`) predicts seconds for: named accelerators from
their makers' datasheets, and this machine, measured by this process's matmul probe
(:func:`zgcore.training.mfu.probe`).

Each figure of :data:`ACCELERATORS` is the dense (no structured sparsity) bfloat16 tensor-core
peak and the memory of the SXM part, from NVIDIA's datasheets:

* H100 SXM5 80 GB: 989 TFLOP/s bf16 dense (the datasheet's 1,979 is "with sparsity"), 80 GB HBM3,
  https://www.nvidia.com/en-us/data-center/h100/ (datasheet table "H100 SXM", "BFLOAT16 Tensor Core").
* H200 SXM 141 GB: 989 TFLOP/s bf16 dense (1,979 with sparsity), 141 GB HBM3e,
  https://www.nvidia.com/en-us/data-center/h200/ (datasheet table "H200 SXM").
* A100 SXM4 80 GB: 312 TFLOP/s bf16 dense (624 with sparsity), 80 GB HBM2e,
  https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
  (table "A100 80GB SXM", "BFLOAT16 Tensor Core").

The MFU a plan states by default: on this machine's CPU the phases measured in docs/performance.md
("Compute utilisation"): 67% of the probe for block training, 70% for the teacher's forwards; on a
named accelerator 40% for every phase (a stated assumption, the usual range of large-model training
at bf16; ``--mfu`` replaces it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

TFLOP = 1e12
GB = 1e9


@dataclass(frozen=True)
class Device:
    """One device a plan runs on. ``peak``: dense FLOP/s at the dtype the phases run in;
    ``memory``: bytes of device memory (0: the host's memory, a CPU); ``source``: where the figures
    come from; ``mfu``: the assumed share of ``peak`` per phase (``train``, ``forward``)."""

    name: str
    peak: float
    memory: int
    source: str
    mfu: dict[str, float]
    accelerator: bool = True


ACCELERATORS: dict[str, Device] = {
    "h100": Device(
        "h100",
        989 * TFLOP,
        80 * GB,
        "NVIDIA H100 SXM5 datasheet, bf16 dense (https://www.nvidia.com/en-us/data-center/h100/)",
        {"train": 0.40, "forward": 0.40},
    ),
    "h200": Device(
        "h200",
        989 * TFLOP,
        141 * GB,
        "NVIDIA H200 SXM datasheet, bf16 dense (https://www.nvidia.com/en-us/data-center/h200/)",
        {"train": 0.40, "forward": 0.40},
    ),
    "a100": Device(
        "a100",
        312 * TFLOP,
        80 * GB,
        "NVIDIA A100 80GB SXM datasheet, bf16 dense (https://www.nvidia.com/content/dam/en-zz/Solutions/"
        "Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf)",
        {"train": 0.40, "forward": 0.40},
    ),
}
CPU_MFU = {"train": 0.67, "forward": 0.70}  # docs/performance.md, "Compute utilisation (MFU)"


def device(name: str, mfu: float | None = None, probe: Callable[[str], dict[str, Any]] | None = None) -> Device:
    """The :class:`Device` called ``name``: ``h100`` | ``h200`` | ``a100`` (the table), or ``cpu`` /
    ``this`` (this machine: the probe's peak, taken now in this process; ``cpu`` with no probe
    import when ``probe`` is given) or ``cuda`` (this machine's GPU, probed). ``mfu`` replaces
    every phase's assumed MFU.

    Raises:
        KeyError: an unknown name (the message lists the known ones).
    """
    key = str(name).lower()
    if key in ACCELERATORS:
        d = ACCELERATORS[key]
    elif key in ("cpu", "this", "cuda") or key.startswith("cuda:"):
        if probe is None:
            from zgcore.training.mfu import probe
        dev = "cpu" if key == "this" else key
        p = probe(dev)
        gpu = dev.startswith("cuda")
        memory = 0
        if gpu:
            import torch

            memory = int(torch.cuda.get_device_properties(torch.device(dev)).total_memory)
        d = Device(
            dev,
            float(p["peak_flops_per_second"]),
            memory,
            f"this process's matmul probe ({p['dtype']}, {p['threads']} threads, n={p['n']})",
            {"train": 0.40, "forward": 0.40} if gpu else dict(CPU_MFU),
            accelerator=gpu,
        )
    else:
        raise KeyError(f"unknown device {name!r}; known: {', '.join([*ACCELERATORS, 'cpu', 'cuda'])}")
    if mfu is not None:
        d = Device(d.name, d.peak, d.memory, d.source, {k: float(mfu) for k in d.mfu}, d.accelerator)
    return d
