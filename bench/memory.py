"""Figure 4: peak resident memory of one TrainBlock / that of end-to-end training of the whole
student, each measured in a fresh subprocess.

* one TrainBlock: block 0 (the first block's kept layers), ``train_block`` reading boundaries
  ``b0 -> b1`` from the store;
* end to end: every block's kept layers chained (the assembled student's decoder stack),
  backpropagating through all of them, ``train_block`` reading ``b0 -> bK`` from the same store
  with the same batch size, objective and optimizer.

Both children start from the same initial weights (written by the parent) and never load the
teacher, so their peaks are the training's own. Each reports its whole-process peak
(``ru_maxrss``), the resident size just before training, and the peak during training
(``VmHWM`` after resetting it through ``/proc/self/clear_refs``).

Run as a child: ``python -m bench.memory SPEC.json`` (prints one JSON line).
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(record: dict, boundaries: list[int], kept: list[list[int]], init_files: list[str], store: Path, t: dict,
            steps: int, workdir: Path) -> dict:
    """Run both children; returns their reports and the ratios."""
    out = {}
    for mode in ("block", "e2e"):
        spec = {"mode": mode, "record": record, "boundaries": boundaries, "kept": kept, "init_files": init_files,
                "store": str(store), "t": {**t, "max_steps": steps}, "work": str(workdir / f"mem-{mode}")}
        spec_path = workdir / f"mem-{mode}.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        r = subprocess.run([sys.executable, "-m", "bench.memory", str(spec_path)], cwd=REPO, env=env,
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"memory child ({mode}) failed:\n{r.stderr[-3000:]}")
        out[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    b, e = out["block"], out["e2e"]
    out["ratio_process"] = b["maxrss_kb"] / e["maxrss_kb"]
    out["ratio_training"] = b["train_peak_kb"] / e["train_peak_kb"]
    out["ratio_increment"] = ((b["train_peak_kb"] - b["before_train_kb"]) /
                              max(1, e["train_peak_kb"] - e["before_train_kb"]))
    return out


def child(spec_path: str) -> None:
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from bench.common import proc_status_kb, reset_peak_rss
    from zgcore.models.adapters import StudentBlock
    from zgcore.data.boundary_store import BoundaryReader
    from zgcore.training.blocks import BlockTraining, block_seed, train_block

    spec = json.loads(Path(spec_path).read_text())
    rec = spec["record"]
    kw = {"gguf_file": rec["gguf_file"]} if rec.get("gguf_file") else {}
    cfg = AutoConfig.from_pretrained(rec["path"], **kw)
    imported_kb = proc_status_kb("VmRSS")
    n_blocks = 1 if spec["mode"] == "block" else len(spec["kept"])
    blocks = []
    for i in range(n_blocks):
        blk = StudentBlock(cfg, spec["kept"][i])
        blk.load_layer_state_dict(load_file(spec["init_files"][i]))
        blocks.append(blk)
    model = blocks[0] if n_blocks == 1 else torch.nn.Sequential(*blocks)
    bs = spec["boundaries"]
    b_in, b_out = bs[0], bs[n_blocks]
    with BoundaryReader(spec["store"]) as reader:
        before = proc_status_kb("VmRSS")
        reset_ok = reset_peak_rss()
        m = train_block(model, reader, b_in, b_out, BlockTraining(spec["t"], block_seed(int(spec["t"]["seed"]), 0),
                        Path(spec["work"]), run_hash="memory"))
        peak = proc_status_kb("VmHWM")
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(json.dumps({"mode": spec["mode"], "layers": sum(len(b.layers) for b in blocks), "trainable_params": n_params,
                      "steps": m["steps"], "imported_kb": imported_kb, "before_train_kb": before,
                      "train_peak_kb": peak if reset_ok else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      "peak_reset": reset_ok, "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


if __name__ == "__main__":
    child(sys.argv[1])
