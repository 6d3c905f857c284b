"""The projections people ask for, from the plan alone (``zerograph plan``'s model, no weights): the
store size, the largest task's host and device memory and the device-hours of the default
experiment's graph for Qwen2.5-1.5B and 3B at 100M tokens and Llama-3.1-8B and 70B at 40M tokens,
K = 4 and 8 partitions, the store in float32 and bfloat16, on 8 H100s (``device = cuda``). Each
teacher is read from a folder holding only its ``config.json`` (``bench/scale_configs.py``).

    python bench/plan_projections.py            # a Markdown table on stdout
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RUNS = (
    ("Qwen2.5-1.5B", 100_000_000),
    ("Qwen2.5-3B", 100_000_000),
    ("Llama-3.1-8B", 40_000_000),
    ("Llama-3.1-70B", 40_000_000),
)


def project(
    name: str, tokens: int, k: int, dtype: str, folder: Path, outputs: str, devices: int = 8, extra: str = ""
) -> dict:
    """The plan's totals for one teacher, token count, K and storage dtype on ``devices`` H100s."""
    import workflows
    from bench.scale_configs import write_config
    from workflows.plan import make_plan
    from zgcore.evaluation.accelerators import device
    from zgcore.models.teacher import config_only

    teacher = write_config(name, folder / name)
    with config_only():
        root = workflows.RunExperiment(
            preset="",
            set=f"teacher={teacher} device=cuda boundary.num_blocks={k} boundary.dtype={dtype} {extra}".strip(),
            outputs=outputs,
        )
        p = make_plan([root.requires()], tokens, device("h100"), devices)
    return p["totals"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--set", default="", help="more overrides for every run")
    a = ap.parse_args(argv)
    from zgcore.evaluation.plan import human

    print(
        "| teacher | tokens | K | store dtype | store | largest task: host / device memory | device-hours | "
        f"wall on {a.devices}xH100 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, tokens in RUNS:
            for k in (4, 8):
                for dtype in ("float32", "bfloat16"):
                    t = project(name, tokens, k, dtype, Path(tmp), str(Path(tmp) / "o"), a.devices, a.set)
                    print(
                        f"| {name} | {tokens / 1e6:.0f}M | {k} | {dtype} | {human(t['store_bytes'])} | "
                        f"{human(t['peak_host_bytes'])} / {human(t['peak_device_bytes'])} ({t['peak_device_task']}) | "
                        f"{t['device_hours']:.1f} | {t['wall_seconds'] / 3600:.1f} h |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
