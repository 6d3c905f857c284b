"""Contracts over every training path (:mod:`zgcore.training.paths`): each registered path, run
from scratch on a tiny random teacher, reads values back from the device at most once per
``log_every`` window, fails on a NaN between two read-backs before any checkpoint is written, and
moves every batch to the device through :func:`zgcore.device.to_device`. The paths are
discovered by importing every module of ``zgcore``: a path added tomorrow is checked the day it
registers, and a module that trains on the loop without registering fails by name. A deliberately
broken dummy path per contract shows each check can fail."""
from __future__ import annotations

import importlib
import math
import pkgutil
import re
import sys
import threading
from pathlib import Path
from unittest import mock

import pytest
import torch

import zgcore
from zgcore.device import to_device
from zgcore.training.loop import CKPT, NonFiniteError, TrainLoop, load_checkpoint
from zgcore.training.paths import PATHS, TrainingPath

ROOT = Path(__file__).resolve().parents[1]
STEPS, LOG_EVERY = 20, 10
NAN_AFTER = 12  # the first optimizer's step after which a parameter turns NaN: between read-backs 10 and 20


def discover() -> dict[str, TrainingPath]:
    """Every registered training path, after importing every module of ``zgcore``."""
    for m in pkgutil.walk_packages(zgcore.__path__, "zgcore."):
        importlib.import_module(m.name)
    return dict(PATHS)


PATH_NAMES = sorted(discover())


# -- the contracts: each raises AssertionError naming the path ---------------------------------------------------

SYNCS = ("item", "cpu", "tolist", "__float__", "__bool__", "__int__", "__index__")


def check_read_backs(path: TrainingPath, folder: Path) -> None:
    """At most one host read-back per ``log_every`` window: values copied from tensors to the host
    (``.item()``, ``.cpu()``, ``.tolist()``, ``float()``, ``bool()``, ``int()`` on a tensor) on the
    training thread while :meth:`TrainLoop.run` runs, outside AdamW's CPU step counters and the
    model's own (transformers' causal-mask builder tests its position ids once per forward)."""
    main, counting, calls = threading.get_ident(), [False], []
    real_run, saved = TrainLoop.run, {}  # noqa: F841

    def shim_for(name):
        real = getattr(torch.Tensor, name)
        saved[name] = real

        def shim(self, *a, **k):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if counting[0] and threading.get_ident() == main and not caller.startswith(("torch.", "transformers.")):
                calls.append(f"Tensor.{name} from {caller}")
            return real(self, *a, **k)
        return shim

    def flagged(real, on):
        def wrapper(self, *a, **k):
            before, counting[0] = counting[0], on
            try:
                return real(self, *a, **k)
            finally:
                counting[0] = before
        return wrapper
    # writing the final state copies it to the host once, after the last read-back: not counted
    with mock.patch.multiple(torch.Tensor, **{n: shim_for(n) for n in SYNCS}), \
            mock.patch.object(TrainLoop, "run", flagged(real_run, True)), \
            mock.patch.object(TrainLoop, "save", flagged(TrainLoop.save, False)):
        path.smoke(folder, {"max_steps": STEPS, "log_every": LOG_EVERY, "checkpoint_every": 0})
    allowed = math.ceil(STEPS / LOG_EVERY)
    assert len(calls) <= allowed, (f"training path {path.name!r}: {len(calls)} host read-backs in {STEPS} steps with "
                                   f"log_every={LOG_EVERY}, at most {allowed} allowed: {sorted(set(calls))}")


def _newest_checkpoints(work: Path) -> list[Path]:
    """The checkpoints a resume would read under ``work``: ``work/checkpoint.pt``, or each pipeline
    stage's newest ``checkpoint-<step>.pt`` (:class:`zgcore.local.stage.StageLoop` keeps them by step; a
    rerun resumes from the last step every stage saved), slowest stage first. Stage 0 runs in its own
    process, where the NaN is not injected, so it may be a checkpoint ahead of the stage that failed."""
    if (work / CKPT).exists():
        return [work / CKPT]
    stages: dict[Path, list[Path]] = {}
    for p in work.rglob("checkpoint-*.pt"):
        stages.setdefault(p.parent, []).append(p)
    step = lambda p: int(p.stem.split("-", 1)[1])  # noqa: E731
    return sorted((max(ps, key=step) for ps in stages.values()), key=step)


def check_nan_before_checkpoint(path: TrainingPath, folder: Path) -> None:
    """A parameter turned NaN after optimizer step 12 (between the read-backs at 10 and 20, with a
    checkpoint due at 15): the run raises :class:`NonFiniteError`, and the checkpoint on disk is
    step 10's, finite."""
    first, real_step = [], torch.optim.AdamW.step

    def step(self, *a, **k):
        out = real_step(self, *a, **k)
        if not first:
            first.append(self)
        if self is first[0]:
            self._zg_steps = getattr(self, "_zg_steps", 0) + 1
            if self._zg_steps == NAN_AFTER:
                with torch.no_grad():
                    self.param_groups[0]["params"][0].fill_(float("nan"))
        return out
    with mock.patch.object(torch.optim.AdamW, "step", step):
        try:
            path.smoke(folder, {"max_steps": STEPS, "log_every": LOG_EVERY, "checkpoint_every": 5})
        except NonFiniteError:
            pass
        else:
            raise AssertionError(f"training path {path.name!r}: a NaN parameter after step {NAN_AFTER} did not fail the run")
    newest = [load_checkpoint(p) for p in _newest_checkpoints(folder / "work")]
    ck = newest[0] if newest else None
    assert ck is not None and ck["step"] == 10, (f"training path {path.name!r}: the checkpoint on disk after a NaN at step "
                                                 f"{NAN_AFTER + 1} is {None if ck is None else ck['step']}, not step 10's")
    for state_of in newest:  # every stage's newest checkpoint is finite, the failed one's included
        for name, state in state_of["modules"].items():
            assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point()), \
                f"training path {path.name!r}: the checkpoint's {name} (step {state_of['step']}) holds a non-finite value"


def check_device_transfer(path: TrainingPath, folder: Path) -> None:
    """Every batch reaches the device through :func:`zgcore.device.to_device`: it is called at
    least once per step by the path's module, and that module moves no tensor to a device itself
    (``Tensor.to``, ``.cuda``, ``.pin_memory``, ``torch.as_tensor`` / ``torch.tensor`` with a device)."""
    import zgcore.device as zdev

    module = sys.modules[path.module]
    real_to_device, moves, direct = zdev.to_device, [], []
    if getattr(module, "to_device", None) is not real_to_device:
        raise AssertionError(f"training path {path.name!r}: {path.module} does not move batches with zgcore.device.to_device")

    def counted(t, device):
        moves.append(tuple(t.shape))
        return real_to_device(t, device)

    def direct_for(owner, name):
        real = getattr(owner, name)

        def shim(*a, **k):
            if sys._getframe(1).f_globals.get("__name__") == path.module and (owner is torch.Tensor or "device" in k):
                direct.append(f"{getattr(owner, '__name__', owner)}.{name}")
            return real(*a, **k)
        return shim
    with mock.patch.object(module, "to_device", counted), \
            mock.patch.multiple(torch.Tensor, **{n: direct_for(torch.Tensor, n) for n in ("to", "cuda", "pin_memory")}), \
            mock.patch.multiple(torch, as_tensor=direct_for(torch, "as_tensor"), tensor=direct_for(torch, "tensor")):
        path.smoke(folder, {"max_steps": STEPS, "log_every": LOG_EVERY, "checkpoint_every": 0})
    assert not direct, f"training path {path.name!r}: {path.module} moves tensors to the device itself: {sorted(set(direct))}"
    assert len(moves) >= STEPS, (f"training path {path.name!r}: {len(moves)} batches through zgcore.device.to_device in "
                                 f"{STEPS} steps")


CONTRACTS = {"read_backs": check_read_backs, "nan_before_checkpoint": check_nan_before_checkpoint,
             "device_transfer": check_device_transfer}


@pytest.mark.parametrize("contract", sorted(CONTRACTS))
@pytest.mark.parametrize("name", PATH_NAMES)
def test_every_training_path_keeps_the_contract(name, contract, tmp_path):
    torch.manual_seed(0)
    CONTRACTS[contract](PATHS[name], tmp_path)


def test_the_registry_holds_every_training_path():
    """Block training, healing, end-to-end distillation (full vocabulary, top-k online and cached) and
    local learning in each execution mode, the pipeline's stages included; and every module that builds
    a TrainLoop (or a subclass: ``TrainLoop(`` in its source) registered one."""
    from zgcore.local.config import ONE_PROCESS

    assert {"block", "heal", "distill/full vocabulary", "distill/top-k online", "distill/top-k cached"} <= set(PATH_NAMES)
    assert {f"local/{m}" for m in ONE_PROCESS} | {"local/pipeline"} <= set(PATH_NAMES)
    builders = set()
    for f in [*(ROOT / "zgcore").rglob("*.py"), *(ROOT / "tasks").rglob("*.py")]:
        if re.search(r"\bTrainLoop\(", f.read_text()) and f.name != "loop.py":
            builders.add(".".join(f.relative_to(ROOT).with_suffix("").parts))
    assert builders and builders <= {p.module for p in PATHS.values()}, builders - {p.module for p in PATHS.values()}


# -- broken dummies: one per contract, each failing it by name ----------------------------------------------------

def _dummy_smoke(folder: Path, settings, flaw: str):
    """A tiny linear model trained on the loop, with one flaw: ``"sync"`` reads its loss back every step,
    ``"nan"`` writes its own checkpoint before the values are read back, ``"transfer"`` moves its
    batches with ``torch.as_tensor(..., device=...)``."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 1)
    steps, every = int(settings["max_steps"]), int(settings.get("checkpoint_every") or 0)
    loop = TrainLoop("dummy", [list(lin.parameters())], {"lr": 1e-2, "weight_decay": 0.0, "grad_clip": 1.0,
                     "warmup_steps": 0, "log_every": settings["log_every"],
                     "checkpoint_every": 0 if flaw == "nan" else every}, steps, folder / "work", "dummy", {"lin": lin}, ["loss"])
    x = torch.randn(8, 4)

    def batches(start):
        for _ in range(start, steps):
            yield torch.as_tensor(x, device="cpu") if flaw == "transfer" else to_device(x, "cpu")

    def step_fn(batch, step):
        loss = (lin(batch) ** 2).mean()
        if flaw == "sync":
            loss.item()
        out = loop.step_on(step, loss)
        if flaw == "nan" and every and (step + 1) % every == 0:
            loop.save(folder / "work" / CKPT)  # written before its values were checked
        return out
    return loop.run(batches, step_fn)


@pytest.mark.parametrize("contract,flaw", [("read_backs", "sync"), ("nan_before_checkpoint", "nan"),
                                           ("device_transfer", "transfer")])
def test_a_broken_dummy_path_fails_each_contract_by_name(contract, flaw, tmp_path):
    from functools import partial

    dummy = TrainingPath(f"dummy with flaw {flaw}", __name__, partial(_dummy_smoke, flaw=flaw))
    sound = TrainingPath("dummy without flaw", __name__, partial(_dummy_smoke, flaw=""))
    CONTRACTS[contract](sound, tmp_path / "sound")  # the same dummy without its flaw keeps the contract
    with pytest.raises(AssertionError, match=re.escape(f"training path 'dummy with flaw {flaw}'")):
        CONTRACTS[contract](dummy, tmp_path / "broken")


def test_to_device_pins_a_pageable_batch_and_copies_it_non_blocking_on_cuda():
    """On CUDA a pageable batch (the cached top-k records before: copied from pageable memory) is
    pinned first and copied with non_blocking; a pinned one is copied as it is; on the CPU the
    batch is returned as it is. (CUDA is mocked: the copy calls are what is checked.)"""
    from zgcore.device import to_device

    calls = []
    real_to = torch.Tensor.to

    def fake_to(self, *a, **k):
        calls.append(("to", str(a[0]), k.get("non_blocking", False), self.__dict__.get("pinned", False)))
        return self

    def fake_pin(self):
        out = self.clone()
        out.__dict__["pinned"] = True
        calls.append(("pin",))
        return out
    x = torch.arange(6.0).reshape(2, 3)
    assert to_device(x, "cpu") is x or torch.equal(real_to(x, "cpu"), to_device(x, "cpu"))
    with mock.patch.object(torch.Tensor, "to", fake_to), mock.patch.object(torch.Tensor, "pin_memory", fake_pin), \
            mock.patch.object(torch.Tensor, "is_pinned", lambda self: self.__dict__.get("pinned", False)):
        to_device(x, "cuda")
        assert calls == [("pin",), ("to", "cuda", True, True)]
        calls.clear()
        pinned = fake_pin(x)
        calls.clear()
        to_device(pinned, torch.device("cuda:0"))
        assert calls == [("to", "cuda:0", True, True)]


def test_online_top_k_targets_read_nothing_back_from_the_device():
    """The teacher's top-k records computed online stay on the teacher's device and packing them
    reads no id back (before: two reads per sequence in pack() and one copy to the host)."""
    from zgcore.data import logit_store as ls

    logits = torch.randn(2, 5, 50)
    ids, logp, rest = ls.teacher_targets(logits, 8, 1.0)
    with mock.patch.object(torch.Tensor, "__int__", side_effect=AssertionError("read back")), \
            mock.patch.object(torch.Tensor, "item", side_effect=AssertionError("read back")):
        rec = ls.pack(ids, logp, rest, vocab=50)
    back = ls.unpack(rec, 8)
    assert torch.equal(back[0], ids) and torch.equal(back[1], logp) and torch.equal(back[2], rest)
    with pytest.raises(ValueError, match="vocabulary has"):
        ls.pack(ids, logp, rest, vocab=ls.MAX_ID + 2)
