"""Memory as a contract over every task family: each family that touches a model runs on a tiny
teacher at two depths (8 and 32 layers, 512 wide, its weights stored in bfloat16 as real teachers'
are, so that loading them as float32 makes them resident rather than a lazily read file mapping) with ``teacher_stream = true``, and
its peak RSS (its own, in one process: ``tests/memory_probe.py``) is flat in depth, ratio at most
1.10, unless it is named in :data:`NOT_FLAT` with why; a named family that turns flat fails too (the
list stays true). Families come from the registry (every ``ZGTask`` subclass); one that touches a
model and is neither measured nor named in :data:`UNMEASURED` fails by name."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_contract_families import discover_families

ROOT = Path(__file__).resolve().parents[1]
RATIO = 1.10
DEPTHS = (8, 32)

# families whose peak grows with the teacher's depth, and why
NOT_FLAT = {
    "Assemble": "loads the whole teacher (float32) for its embedding, final norm, LM head and buffers",
    "ScoreUntrained": "loads the whole teacher (float32) to assemble the untrained student around the blocks",
}
# model-touching families the two measured graphs do not build (their smoke graphs are minutes at two depths)
UNMEASURED = {
    "AssembleExact": "library_tiny", "ScoreCandidate": "library_tiny", "ScoreStudent": "library_tiny",
    "LayerImportance": "library_tiny (loads the whole teacher: it measures every layer's channels)",
    "DistillE2E": "distill_tiny", "EvaluateStudent": "distill_tiny", "ScoreBlock": "an lr search (tiny_seeds)",
    "PretrainLocal": "local_tiny (no teacher: greedy local learning from scratch)",
    "EvaluateLocal": "local_tiny (no teacher)",
}


def problems(peaks: dict[int, dict[str, float]], families: dict, not_flat: dict, unmeasured: dict) -> list[str]:
    """What breaks the contract: a model-touching family (``uses_device``) neither measured nor named
    unmeasured, a family not named in ``not_flat`` whose peak grows more than :data:`RATIO` from the
    first depth to the last, or one named there whose peak does not."""
    lo, hi = peaks[DEPTHS[0]], peaks[DEPTHS[-1]]
    out = [f"{f}: touches a model but is neither measured nor named in UNMEASURED" for f, c in sorted(families.items())
           if c.uses_device and f not in hi and f not in unmeasured]
    for f in sorted(set(lo) & set(hi)):
        r = hi[f] / lo[f]
        if f not in not_flat and r > RATIO:
            out.append(f"{f}: peak RSS {lo[f]:.0f} MiB at {DEPTHS[0]} layers, {hi[f]:.0f} MiB at {DEPTHS[-1]} "
                       f"(ratio {r:.2f} > {RATIO}): it holds more than its own layers")
        if f in not_flat and r <= RATIO:
            out.append(f"{f}: named in NOT_FLAT but flat (ratio {r:.2f}): take it off the list")
    return out


def _teacher(path: Path, n_layers: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from zgcore.models.teacher import byte_tokenizer, tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", n_layers=n_layers, hidden=512)).to(torch.bfloat16)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    # the config keeps float32 as the dtype models are built in (StudentBlock follows the config's dtype)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "dtype": "float32"}))
    return path


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = {}
    for n in DEPTHS:
        teacher = _teacher(root / f"teacher-{n}", n)
        r = subprocess.run([sys.executable, "-m", "tests.memory_probe", str(teacher), str(root / f"out-{n}"), "tiny",
                            "heal_topk_tiny"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
                           check=False)
        assert r.returncode == 0, r.stderr[-3000:]
        out[n] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def test_every_family_s_peak_memory_is_flat_in_teacher_depth_unless_named(peaks):
    for f in sorted(peaks[DEPTHS[-1]]):  # the figures (docs/scale.md), with -s
        print(f"{f}: {peaks[DEPTHS[0]].get(f, 0):.0f} -> {peaks[DEPTHS[-1]][f]:.0f} MiB")
    found = problems(peaks, discover_families(), NOT_FLAT, UNMEASURED)
    assert not found, "\n".join(found)
    assert {"BoundaryShard", "ScoreTeacher", "TeacherLogits", "TrainBlock", "BoundaryShift", "Heal"} <= set(peaks[32])


def test_a_family_that_holds_the_whole_teacher_breaks_the_contract_by_name(peaks):
    families = discover_families()
    assert any("Assemble: peak RSS" in p for p in problems(peaks, families, {}, UNMEASURED))  # not named: caught
    fake = {n: {**p, "BoundaryShard": p["BoundaryShard"] * (n / 8) ** 0.5} for n, p in peaks.items()}  # a dummy
    assert any(p.startswith("BoundaryShard: peak RSS") for p in problems(fake, families, NOT_FLAT, UNMEASURED))
    assert any(p.startswith("TrainBlock: named in NOT_FLAT but flat")
               for p in problems(peaks, families, {**NOT_FLAT, "TrainBlock": "?"}, UNMEASURED))
    assert any(p.startswith("Heal: touches a model") for p in problems(
        {n: {k: v for k, v in p.items() if k != "Heal"} for n, p in peaks.items()}, families, NOT_FLAT, UNMEASURED))
