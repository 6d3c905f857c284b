"""What the configuration decides, for every preset and a set of ``--set`` overrides: the resolved
dict, and every task of each workflow's graph with its id, output folder and hashed configuration.
``tests/test_config_snapshot.py`` compares it with ``tests/config_snapshot.json``, recorded from the
code before the settings became declarations, so that no task id moves.

The suite checks every preset without an override and every override on one tiny preset per schema and graph
shape (:data:`SUITE`); ``PYTHONPATH=$PWD .venv/bin/python -m tests.config_snapshot --check`` checks all cases
(a minute or two). Re-record (only when an id is meant to move): ``... -m tests.config_snapshot --write``.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

SNAPSHOT = Path(__file__).with_name("config_snapshot.json")

# overrides of the experiment schema, each tried on every experiment preset (an override a preset rejects records
# only that it is rejected)
EXPERIMENT_OVERRIDES = [
    "", "name=other device=cpu", "train.mixer=window train.window=8", "train.mixer=linear",
    "train.objective=noisy train.noise=0.2", "train.objective=denoise", "train.max_steps=3", "train.n_layers=1",
    "train.lrs=[1e-3,2e-3] eval.max_sequences=4", "blocks.1.lr=5e-4 blocks.0.max_steps=2",
    "train.ce_weight=0.1 train.mtp_weight=0.2 train.mtp_n=3", "train.compile=true", "train.keep=importance",
    "train.intermediate_size=32",
    ("train.prefetch=0 train.log_every=3 train.checkpoint_every=7 train.tensorboard=false "
     "train.prefetch_workers=2 train.prefetch_mode=thread"), "heal.steps=3 heal.top_k=8",
    "heal.steps=3 heal.top_k=8 heal.targets=cached", "heal.steps=2 heal.log_every=1 heal.tensorboard=false",
    "distill.lrs=[1e-4,3e-4] eval.max_sequences=4", "boundary.shard_sequences=16 boundary.batch_size=4",
    "boundary.boundaries=[0,1,2]", "train.batch_size=4.0 train.epochs=2", "library.context=64",
    "eval.extra=[stdlib-docstrings] eval.max_sequences=6 eval.subset_seed=2", "seeds=[0,1]",
]
LOCAL_OVERRIDES = [
    "", "name=x device=cpu", "local.K=2", "train.log_every=3 train.checkpoint_every=9 train.tensorboard=false",
    "study.lrs=[1e-3,3e-3]", "train.execution=pipeline", "study.configs=[{K: 1}, {K: 2, execution: pipeline}]",
    "seeds=[0,1]", "model.vocab=full", "local.K=2 local.mtp_boundaries=[1]", "study.flops_matched=true",
]


# the presets every override is tried on in the suite
SUITE = ("tiny", "distill_tiny", "library_tiny", "local_tiny")


def _digest(obj) -> str:
    from zgcore.hashing import canonical_json

    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()[:16]


def record(preset: str, over: str) -> dict:
    """One case: ``{"error": True}`` when the configuration is rejected, else digests of the resolved dict
    (type-exact JSON, so 4 and 4.0 differ) and of every task's (family, id, folder, hashed config)."""
    import luigi
    import luigi.task

    import workflows
    from workflows import registry
    from workflows.experiment import load_preset, walk
    from zgcore.config.experiment import ConfigError, resolve
    from zgcore.local.resolve import resolve_local

    wf = registry.owner(preset)
    luigi.task_register.Register.clear_instance_cache()
    try:
        if wf.schema == "local":
            cfg = resolve_local(None, over or None, base=load_preset(preset, "local"))
        else:
            cfg = resolve(None, over or None, base=load_preset(preset))
        roots = luigi.task.flatten(getattr(workflows, wf.name)(config="", set=over, preset=preset,
                                                               outputs="out").requires())
    except (ConfigError, SystemExit):
        return {"error": True}
    tasks = {}
    for r in roots:
        for t in walk(r):
            tasks[t.task_id] = [t.get_task_family(), str(t.out_dir), t.own_config()]
    return {"resolved": hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16],
            "tasks": _digest(sorted(tasks.items())), "n_tasks": len(tasks)}


def cases() -> list[tuple[str, str]]:
    """Every (preset, override) pair: the experiment overrides on every experiment preset, the local ones on
    every local preset."""
    from workflows import registry

    out = []
    for preset in registry.preset_files():
        wf = registry.owner(preset)
        out += [(preset, o) for o in (LOCAL_OVERRIDES if wf.schema == "local" else EXPERIMENT_OVERRIDES)]
    return out


def snapshot() -> dict[str, dict]:
    """``{"<preset> | <override>": record}`` for every case."""
    return {f"{p} | {o}": record(p, o) for p, o in cases()}


def moved(keys) -> list[str]:
    """The cases among ``keys`` (``"<preset> | <override>"``) whose record differs from the snapshot's."""
    want = json.loads(SNAPSHOT.read_text())
    return [k for k in keys if record(*k.split(" | ", 1)) != want[k]]


if __name__ == "__main__":
    if "--check" in sys.argv:
        bad = moved([f"{p} | {o}" for p, o in cases()])
        print(f"{len(cases()) - len(bad)} of {len(cases())} cases as recorded; moved: {bad}")
        sys.exit(1 if bad else 0)
    snap = snapshot()
    if "--write" in sys.argv:
        SNAPSHOT.write_text(json.dumps(snap, indent=1, sort_keys=True) + "\n")
    print(sum(not r.get("error") for r in snap.values()), "of", len(snap), "cases resolve")
