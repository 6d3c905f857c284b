"""Full disks, shared outputs folders, unwritable folders, teacher files that are not what they claim
(docs/reliability.md, "Full disks and shared folders"). Fast: ENOSPC is injected (monkeypatched
writes, or a tmpfs of 1 MiB mounted inside the test when it runs as root); the whole-graph trials are
scripts/reliability.py's."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from zgcore import atomic
from zgcore.atomic import NoSpaceError, atomic_path, is_no_space, write_json
from zgcore.checks import ConfigError

REPO = Path(__file__).resolve().parents[1]
ROOT = os.geteuid() == 0


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MiB tmpfs, filled to its last byte (root only: mount needs it)."""
    if not ROOT:
        pytest.skip("mounting a small tmpfs needs root; the monkeypatched tests cover the same paths")
    mnt = tmp_path / "full"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("this container cannot mount a tmpfs")
    try:
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError:
            pass
        os.close(fd)
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)])


def test_is_no_space_recognises_each_writers_way_of_saying_it(tmp_path, monkeypatch):
    h5 = RuntimeError("Can't decrement id ref count (file write failed: ..., errno = 28, error message = 'No space")
    assert is_no_space(OSError(errno.ENOSPC, "No space left on device"))
    assert is_no_space(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_no_space(h5)
    assert is_no_space(Exception("Error while serializing: I/O error: No space left on device (os error 28)"))
    torch_err = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(atomic, "free_bytes", lambda p: (0, 5 << 20))
    assert is_no_space(torch_err, tmp_path)  # torch says nothing of the disk: the file system is full
    monkeypatch.setattr(atomic, "free_bytes", lambda p: (10 << 30, 20 << 30))
    assert not is_no_space(torch_err, tmp_path)  # plenty free: some other failure, not called a full disk
    assert not is_no_space(ValueError("a bug"), tmp_path)
    assert not is_no_space(OSError(errno.EIO, "Input/output error"))


def test_atomic_path_turns_enospc_into_one_line_and_removes_the_partial(tmp_path):
    target = tmp_path / "out" / "block.safetensors"
    with pytest.raises(NoSpaceError) as e, atomic_path(target) as tmp:
        tmp.write_bytes(b"x" * 3000)
        raise OSError(errno.ENOSPC, "No space left on device")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("no space left on device writing ") and str(target) in msg
    assert "rerun the same command" in msg and " free of " in msg and e.value.errno == errno.ENOSPC
    assert list(target.parent.iterdir()) == []  # neither the final name nor the temporary
    with pytest.raises(ValueError):  # other errors pass unchanged
        with atomic_path(target) as tmp:
            raise ValueError("not a disk")


@pytest.mark.parametrize("writer", ["text", "json", "safetensors", "torch"])
def test_each_writer_on_a_full_disk_raises_no_space_and_leaves_nothing(full_disk, writer):
    from zgcore.training.blocks import save_weights

    t = {"w": torch.randn(256, 256)}
    target = full_disk / "task" / f"out.{writer}"
    with pytest.raises(NoSpaceError, match="no space left on device writing"):
        if writer == "text":
            atomic.write_text(target, "y" * (2 << 20))
        elif writer == "json":
            write_json(target, {"x": "y" * 8192})
        elif writer == "safetensors":
            save_weights(target, t)
        else:
            with atomic_path(target) as tmp:
                torch.save(t, tmp)
    assert not [p for p in full_disk.rglob("*") if p.is_file() and p.name != "filler"]


H5_CHILD = """
import sys, numpy as np, h5py
from pathlib import Path
from zgcore.data import h5write
from zgcore.atomic import atomic_path
target = Path(sys.argv[1]) / "b0.h5"
try:
    with atomic_path(target) as tmp:
        if sys.argv[2] == "ours":
            with h5write.writing(tmp) as f:
                d = f.create_dataset("h", shape=(64, 64, 64), dtype="f4")
                for k in range(64):
                    d[k] = np.ones((64, 64), "f4")
        else:  # what write_shard did: a plain close in a finally
            f = h5py.File(tmp, "w")
            try:
                d = f.create_dataset("h", shape=(64, 64, 64), dtype="f4")
                for k in range(64):
                    d[k] = np.ones((64, 64), "f4")
            finally:
                f.close()
except Exception as e:
    print(type(e).__name__, str(e).splitlines()[0][:60])
"""


def test_an_hdf5_writer_on_a_full_disk_fails_cleanly_where_a_plain_close_crashes(full_disk):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    filler = full_disk / "filler"
    os.truncate(filler, filler.stat().st_size - (300 << 10))  # 300 KiB left: the 1 MiB dataset fills it mid-write
    ours = subprocess.run(
        [sys.executable, "-c", H5_CHILD, str(full_disk), "ours"], capture_output=True, text=True, env=env
    )
    assert ours.returncode == 0, ours.stderr[-500:]
    assert ours.stdout.startswith("NoSpaceError no space left on device writing"), ours.stdout
    assert not (full_disk / "b0.h5").exists() and not [p for p in full_disk.iterdir() if p.name != "filler"]
    plain = subprocess.run(
        [sys.executable, "-c", H5_CHILD, str(full_disk), "plain"], capture_output=True, text=True, env=env
    )
    assert plain.returncode == -11, (plain.returncode, plain.stderr[-300:])  # the crash the close order avoids


def test_a_task_built_by_another_run_meanwhile_is_waited_for_and_kept(tmp_path):
    from tasks.exclusive import alone, lock_path

    out = tmp_path / "Fam" / "label-abc"
    said: list[str] = []
    task = SimpleNamespace(
        out_dir=out, log=said.append, check_output=lambda: None if (out / "x").is_file() else ("damaged", "")
    )
    other = SimpleNamespace(out_dir=out, log=said.append, check_output=task.check_output)
    started, results = threading.Event(), {}

    def first():
        with alone(task) as done:
            results["first"] = done
            started.set()
            time.sleep(0.5)
            out.mkdir(parents=True)
            (out / "x").write_text("built once")

    t = threading.Thread(target=first)
    t.start()
    started.wait()
    with alone(other) as done:  # waits for the first, then finds its whole output
        results["second"] = done
    t.join()
    assert results == {"first": False, "second": True}
    assert (out / "x").read_text() == "built once" and not lock_path(task).exists()
    assert any("waiting for another run" in s for s in said) and any("built by another run" in s for s in said)


def test_held_out_and_outputs_checks_fail_before_any_task(tmp_path):
    from workflows.experiment import load_config
    from workflows.preflight import check_outputs

    with pytest.raises(ConfigError, match=r"corpus.max_tokens=64 gives at most 2 sequence\(s\).*at least 2 held-out"):
        load_config(preset="tiny", overrides="corpus.max_tokens=64")
    with pytest.raises(ConfigError, match="eval.max_sequences=1"):
        load_config(preset="tiny", overrides="eval.max_sequences=1")
    load_config(preset="tiny", overrides="corpus.max_tokens=480")  # the bound the message names passes
    with pytest.raises(ConfigError, match="lower eval.max_sequences below"):
        load_config(preset="tiny", overrides="corpus.max_tokens=640 eval.max_sequences=2 train.lrs=[1e-3,2e-3]")
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        check_outputs(tmp_path / "afile")
    check_outputs(tmp_path / "new" / "outputs")  # a missing folder is created
    assert (tmp_path / "new" / "outputs").is_dir() and not list((tmp_path / "new" / "outputs").iterdir())
    if ROOT:
        ro = tmp_path / "ro"
        ro.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(ro)]).returncode == 0:
            try:
                with pytest.raises(ConfigError, match=r"cannot be written \(Read-only file system\)"):
                    check_outputs(ro / "out")
            finally:
                subprocess.run(["umount", str(ro)])


def _gguf(path: Path) -> bytes:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    w.add_array("tokenizer.ggml.scores", [0.1, 0.2, 0.3])
    w.add_tensor("t1", np.ones((4, 8), np.float32))
    w.add_tensor("t2", np.ones((16,), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def test_teacher_files_that_are_not_what_they_claim_say_what_they_are(tmp_path):
    from safetensors.torch import save_file

    from zgcore.models.teacher_files import check_config_json, check_gguf, check_safetensors

    data = _gguf(tmp_path / "ok.gguf")
    check_gguf(tmp_path / "ok.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(range(200, 256)) * 10)
    with pytest.raises(ConfigError, match=r"is not a GGUF file: its first bytes are c8 c9 ca .*unrecognised binary"):
        check_gguf(bad)
    bad.write_bytes(b'{"not": "gguf"}')
    with pytest.raises(ConfigError, match="is not a GGUF file: .*JSON text"):
        check_gguf(bad)
    for cut in (10, 30, 100, 200):
        bad.write_bytes(data[:cut])
        with pytest.raises(ConfigError, match=rf"cut short or damaged: the read stopped at byte \d+ of {cut} reading"):
            check_gguf(bad)
    bad.write_bytes(data[:-20])
    with pytest.raises(
        ConfigError, match=rf"cut short: tensor 't2' ends at byte {len(data)}, the file holds {len(data) - 20}"
    ):
        check_gguf(bad)
    st = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(64, 64)}, str(st))
    check_safetensors(st)
    whole = st.read_bytes()
    st.write_bytes(whole[:1000])
    with pytest.raises(ConfigError, match="cut short: tensor 'w' ends at byte"):
        check_safetensors(st)
    st.write_bytes(data)
    with pytest.raises(ConfigError, match="are not a safetensors file: .*a GGUF file"):
        check_safetensors(st)
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "llama",\n')
    with pytest.raises(ConfigError, match=r"is not JSON: the parse stopped at line 2, column 1 \(byte 24\)"):
        check_config_json(cfg)


def test_the_luigi_command_fails_bad_inputs_in_one_line_exit_2_before_any_task(tmp_path):
    junk = tmp_path / "teacher.gguf"
    junk.write_bytes(os.urandom(4096))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for setting, words in [(f"teacher={junk}", "is not a GGUF file: its first bytes are")]:  # the rest: in-process
        r = subprocess.run(
            [
                str(REPO / ".venv/bin/luigi"),
                "--module",
                "workflows",
                "RunExperiment",
                "--local-scheduler",
                "--preset",
                "tiny",
                "--set",
                setting,
                "--outputs",
                str(tmp_path / "out"),
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=300,
        )
        errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
        assert r.returncode == 2 and len(errors) == 1 and words in errors[0], (r.returncode, r.stderr[-500:])
        assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()  # nothing ran, nothing written


def test_the_campaign_judges_a_trials_ending_and_takes_its_families_from_the_registry(tmp_path):
    from scripts import reliability as campaign

    def ended(code, err):
        return campaign.one_line_outcome(SimpleNamespace(returncode=code, stderr=err, stdout=""))

    good = "error: BoundaryShard train: no space left on device writing /x: ... (ZG_TRACEBACK=1 shows the traceback)\n"
    assert ended(30, good) is None
    assert ended(-11, good) == "exit -11 (a signal)" and ended(139, good) == "exit 139 (a signal)"
    assert ended(0, "") == "exit 0 on a full disk"
    assert ended(30, good + good).startswith("2 error line(s)")
    assert ended(30, "Traceback (most recent call last):\nOSError: [Errno 28]\n").startswith("a traceback")
    from workflows import registry

    wf = registry.get("RunExperiment")
    tasks = campaign.graph(wf.name, wf.tiny, tmp_path)
    families = {t.get_task_family() for t in tasks}
    assert {"PrepareCorpus", "TrainBlock", "Evaluate"} <= families  # shards join once the corpus is known
    below = {t.get_task_family() for t in campaign.downstream(tasks, "TrainBlock")}
    assert below == {"TrainBlock", "Assemble", "ScoreAssembled", "BoundaryShift", "Evaluate"}, below
