"""The one training loop: non-finite values fail at once and keep the last checkpoint; checkpoints
load with weights_only, a transient read error keeps the file, a malformed one is moved aside."""
import errno
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import tiny_cfg
from zgcore.training.loop import CKPT, NonFiniteError, TrainLoop, load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
T = {"lr": 1e-2, "weight_decay": 0.0, "grad_clip": 1.0, "warmup_steps": 0, "checkpoint_every": 2}


def _loop(work, **t):
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3)
    loop = TrainLoop("test", [list(lin.parameters())], {**T, **t}, 6, work, "h", {"lin": lin}, ["loss"])
    x = torch.randn(4, 3)

    def step_fn(batch, step):
        loss = (lin(x) ** 2).mean() * batch
        v = loop.check(step, "the loss", loss.item())
        loop.zero_grad()
        loss.backward()
        loop.update(0, step)
        return [v]
    return loop, lin, step_fn


def test_non_finite_loss_stops_at_once_and_keeps_the_last_checkpoint(tmp_path):
    loop, lin, step_fn = _loop(tmp_path)
    scale = [1.0, 1.0, 1.0, float("inf"), 1.0, 1.0]  # step 4 overflows
    with pytest.raises(NonFiniteError, match=r"test: the loss is inf at step 4 of 6.*last checkpoint is kept.*Lower train.lr"):
        loop.run(lambda s: iter(scale[s:]), step_fn)
    assert load_checkpoint(tmp_path / CKPT)["step"] == 2  # taken before the fault, kept for inspection
    assert not (tmp_path / "loss_log.csv").exists() and not (tmp_path / "train_state.pt").exists()


def test_non_finite_gradient_norm_fails_even_without_clipping():
    w = torch.nn.Parameter(torch.zeros(2))
    loop = TrainLoop("test", [[w]], {**T, "grad_clip": 0}, 3, None, "h", {}, ["loss"])

    def step_fn(batch, step):
        loss = torch.sqrt(w).sum()  # 0: finite; its gradient at 0 is inf
        v = loop.check(step, "the loss", loss.item())
        loop.zero_grad()
        loss.backward()
        loop.update(0, step)
        return [v]
    with pytest.raises(NonFiniteError, match=r"the gradient norm is inf at step 1 of 3") as e:
        loop.run(lambda s: iter([None] * 3), step_fn)
    assert e.value.step == 1 and e.value.what == "the gradient norm"  # found at the read-back, named where it began


def test_checkpoint_io_error_keeps_the_file_and_malformed_ones_are_moved_aside(tmp_path, monkeypatch):
    loop, lin, step_fn = _loop(tmp_path)
    loop.run(lambda s: iter([1.0] * 6), step_fn)
    good = tmp_path / "train_state.pt"
    assert load_checkpoint(good)["step"] == 6
    real_load = torch.load

    def flaky(*a, **k):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(torch, "load", flaky)
    with pytest.raises(OSError, match="could not be read.*it is kept"):
        load_checkpoint(good)
    assert good.exists() and not list(tmp_path.glob(good.name + ".corrupt*"))
    monkeypatch.setattr(torch, "load", real_load)
    # truncated: moved aside, not used
    bad = tmp_path / "truncated.pt"
    bad.write_bytes(good.read_bytes()[:300])
    assert load_checkpoint(bad) is None and not bad.exists() and len(list(tmp_path.glob("truncated.pt.corrupt-*"))) == 1
    # the same file malformed again within the same second: every copy is kept, none replaces another
    for n in (2, 3):
        bad.write_bytes(good.read_bytes()[:300 + n])
        assert load_checkpoint(bad) is None and not bad.exists()
    assert sorted(p.stat().st_size for p in tmp_path.glob("truncated.pt.corrupt-*")) == [300, 302, 303]


def test_a_flipped_byte_in_a_checkpoint_never_resumes_other_values(tmp_path):
    """torch.load does not check its zip's CRC-32 (a flipped tensor byte loads silently); the
    checkpoint's content digest does: every flip (seeded sample of 400 offsets) loads the same
    content or is moved aside as malformed."""
    loop, lin, step_fn = _loop(tmp_path)
    loop.run(lambda s: iter([1.0] * 6), step_fn)
    good = tmp_path / "train_state.pt"
    ref = load_checkpoint(good)
    raw = good.read_bytes()
    same = refused = 0
    for off in sorted(set(np.random.default_rng(2).integers(0, len(raw), 400).tolist())):
        path = tmp_path / f"flip{off}.pt"
        bad = bytearray(raw)
        bad[off] ^= 0xFF
        path.write_bytes(bad)
        ck = load_checkpoint(path)
        if ck is None:
            assert len(list(tmp_path.glob(path.name + ".corrupt-*"))) == 1
            refused += 1
        else:
            assert ck["digest"] == ref["digest"] and torch.equal(ck["modules"]["lin"]["weight"], ref["modules"]["lin"]["weight"])
            same += 1
    assert refused > 300  # most bytes matter; the rest (zip padding, names) load the same content


def test_train_state_is_byte_identical_with_and_without_a_resume(tmp_path):
    """A run interrupted after its step-4 checkpoint and resumed in a fresh loop (new module, new
    optimizer, state read back from the file) writes the same train_state.pt bytes as a run that
    never stopped (pickle's back-references to shared strings once made them differ)."""
    (tmp_path / "once").mkdir()
    loop, _, step_fn = _loop(tmp_path / "once")
    loop.run(lambda s: iter([1.0] * (6 - s)), step_fn)

    (tmp_path / "resumed").mkdir()
    loop, _, step_fn = _loop(tmp_path / "resumed", checkpoint_every=4)

    def dies_at_5(batch, step):
        if step == 4:
            raise KeyboardInterrupt  # after the checkpoint of step 4
        return step_fn(batch, step)
    with pytest.raises(KeyboardInterrupt):
        loop.run(lambda s: iter([1.0] * (6 - s)), dies_at_5)
    assert load_checkpoint(tmp_path / "resumed" / CKPT)["step"] == 4
    loop, _, step_fn = _loop(tmp_path / "resumed", checkpoint_every=4)
    assert loop.run(lambda s: iter([1.0] * (6 - s)), step_fn)["resumed_from"] == 4
    once, resumed = ((tmp_path / d / "train_state.pt").read_bytes() for d in ("once", "resumed"))
    assert load_checkpoint(tmp_path / "once" / "train_state.pt")["step"] == 6
    assert once == resumed


class _Boom:
    def __reduce__(self):
        return (Path.touch, (Path(BOOM),))


BOOM = ""


def test_checkpoints_never_unpickle_code(tmp_path):
    global BOOM
    BOOM = str(tmp_path / "pwned")
    path = tmp_path / CKPT
    torch.save({"format": 2, "modules": {}, "optimizers": [], "torch_rng": torch.get_rng_state(), "step": 1,
                "log": [_Boom()], "run_hash": "h"}, path)
    assert load_checkpoint(path) is None  # refused by weights_only: moved aside
    assert not Path(BOOM).exists() and len(list(tmp_path.glob(CKPT + ".corrupt-*"))) == 1


def test_trainblock_with_exploding_lr_fails_with_a_message_and_leaves_no_output(tmp_path):
    out = tmp_path / "o"
    r = subprocess.run([sys.executable, "-m", "luigi", "--module", "workflows", "RunExperiment", "--local-scheduler",
                        "--preset", "", "--outputs", str(out), "--set",
                        tiny_cfg(**{"train.lr": 1e9, "train.grad_clip": 0, "train.max_steps": 12, "train.checkpoint_every": 1})],
                       cwd=ROOT, capture_output=True, text=True)
    log = r.stdout + r.stderr
    assert r.returncode != 0
    assert "NonFiniteError: TrainBlock block0-clean-cached-s0: the loss is" in log and "Lower train.lr (now 1e+09)" in log
    assert "set train.grad_clip > 0 (now 0" in log
    assert not [p for p in out.glob("TrainBlock/*") if not p.name.endswith(".partial")]  # no output folder
    assert list(out.glob("TrainBlock/block0-*.partial/checkpoint.pt"))  # the last good checkpoint is kept
    assert not list(out.glob("Assemble/*"))


def test_a_later_training_stage_heal_with_exploding_lr_fails_and_keeps_nothing(tmp_path, run_graph):
    """Healing (end-to-end KD after Assemble) runs on the same loop: a non-finite value fails Heal
    at once, names it and the step, leaves no Heal folder and no report, keeps its last checkpoint."""
    import luigi

    from workflows import RunExperiment

    failures = []
    handler = luigi.Task.event_handler(luigi.Event.FAILURE)(lambda task, exc: failures.append((task, exc)))
    cfg = tiny_cfg(**{"train.max_steps": 2, "heal.steps": 12, "heal.lr": 1e9, "heal.grad_clip": 0,
                      "heal.batch_size": 2, "heal.checkpoint_every": 1})
    try:
        ok, ran = run_graph(RunExperiment(preset="", set=cfg, outputs=str(tmp_path)))
    finally:
        luigi.Task._event_callbacks[luigi.Task][luigi.Event.FAILURE].discard(handler)
    assert not ok
    (task, exc), = [(t, e) for t, e in failures if t.get_task_family() == "Heal"]
    assert isinstance(exc, NonFiniteError)
    assert re.match(r"Heal healed-12: the (KD term|loss|gradient norm) is (nan|inf|-inf) at step \d+ of 12", str(exc))
    assert "(now 1e+09)" in str(exc)
    assert not task.out_dir.exists() and not list(tmp_path.glob("Evaluate/*"))
    assert (task.work_dir / CKPT).is_file()  # the last checkpoint before the fault, for inspection


def test_a_nan_between_two_read_backs_fails_the_run_and_writes_no_checkpoint_or_result_of_it(tmp_path):
    """Losses and gradient norms stay on the device and are read back every ``log_every`` steps:
    a NaN at step 6 (read-backs at 4, 8 and 12; checkpoints at 4 and 8) fails the run at the
    step-8 read-back, naming step 6, before the step-8 checkpoint is written: the step-4 checkpoint
    is the one kept, and no loss log or final state is written."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3)
    loop = TrainLoop("test", [list(lin.parameters())], {**T, "checkpoint_every": 4, "log_every": 4}, 12, tmp_path,
                     "h", {"lin": lin}, ["loss"])
    x = torch.randn(4, 3)
    seen = []

    def step_fn(batch, step):
        loss = (lin(x) ** 2).mean() * batch
        return loop.step_on(step, loss)
    scale = [1.0] * 12
    scale[5] = float("nan")
    with pytest.raises(NonFiniteError, match=r"test: the loss is nan at step 6 of 12") as e:
        loop.run(lambda s: iter(scale[s:]), step_fn, progress=lambda s, n, v: seen.append(s))
    assert e.value.step == 6
    ck = load_checkpoint(tmp_path / CKPT)
    assert ck["step"] == 4 and all(torch.isfinite(t).all() for t in ck["modules"]["lin"].values())
    assert not (tmp_path / "loss_log.csv").exists() and not (tmp_path / "train_state.pt").exists()
    assert seen == [1, 2, 3, 4, 5]  # the steps before the non-finite one are reported, it and those after never


def test_training_syncs_with_the_host_once_per_read_back_not_per_step(tmp_path, monkeypatch):
    """A block trained 40 steps with ``log_every`` 10 and a checkpoint at step 20 copies values from
    the device to the host (``.item()``, ``.cpu()``, ``.tolist()``, ``float()``, ``bool()`` on a
    tensor, counted on the training thread, outside the checkpoint writer and AdamW's CPU step
    counters) at most once per
    read-back: 4 read-backs (steps 10, 20, 30, 40) plus the checkpoint; before, it was one per step
    and per value. The loss log holds every step all the same. (transformers' own causal-mask
    builder still tests the position ids once per forward; counted apart.)"""
    import threading

    from zgcore.data.boundary_store import BoundaryReader, build_store
    from zgcore.models.adapters import build_block
    from zgcore.models.teacher import load, materialise
    from zgcore.training.blocks import BlockTraining, train_block

    model, _ = load(materialise("tiny-llama", outputs=tmp_path))
    rng = np.random.default_rng(0)
    tokens = {"train": rng.integers(0, 256, (16, 16)).astype(np.int32), "val": rng.integers(0, 256, (4, 16)).astype(np.int32)}
    build_store(tmp_path / "store", model, tokens, [0, 2], "float32", 4, {}, log=lambda m: None)
    block = build_block(model, [0, 1], "teacher", 3)
    t = {"objective": "noisy", "noise": 0.1, "loss_norm": "channel", "lr": 1e-3, "weight_decay": 0.0, "grad_clip": 1.0,
         "warmup_steps": 2, "max_steps": 40, "epochs": 1, "batch_size": 4, "checkpoint_every": 20, "log_every": 10,
         "prefetch": 0}
    main, counting, calls = threading.get_ident(), [True], []

    def counted(name):
        real = getattr(torch.Tensor, name)

        def shim(self, *a, **k):
            # AdamW's step counters live on the CPU whatever the device (not capturable): reading them is no device sync
            caller = sys._getframe(1).f_globals.get("__name__", "")
            # transformers' mask builder tests its position ids with one bool() per forward (masking_utils
            # find_packed_sequence_indices): the model's own, counted apart below
            if counting[0] and threading.get_ident() == main and not caller.startswith("torch.optim"):
                calls.append(f"{name} from {caller}")
            return real(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, shim)
    for name in ("item", "cpu", "tolist", "__float__", "__bool__"):
        counted(name)
    real_save = TrainLoop.save

    def save(self, path):  # writing a checkpoint copies the state to the host: counted as one, below
        counting[0] = False
        try:
            real_save(self, path)
        finally:
            counting[0] = True
    monkeypatch.setattr(TrainLoop, "save", save)
    with BoundaryReader(tmp_path / "store") as r:
        calls.clear()
        m = train_block(block, r, 0, 2, BlockTraining(t, 3, tmp_path / "work", "h"))
    assert m["steps"] == 40 and len((tmp_path / "work" / "loss_log.csv").read_text().splitlines()) == 41
    ours = [c for c in calls if not c.split(" from ")[1].startswith("transformers.")]
    assert 4 <= len(ours) <= 40 // 10 + 1, ours  # one per read-back (+1 checkpoint), not one per step
    assert len(calls) - len(ours) <= 40  # at most the model's own mask check, once per forward
