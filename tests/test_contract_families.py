"""Contracts over every task family: the ``ZGTask`` subclasses, discovered by importing every module
of ``tasks`` and ``workflows``, each built by the smoke graphs below (the tiny presets, and the
tiny experiment with seeds and out-of-domain text); a family that no smoke graph builds fails by
name, so a family added tomorrow is checked the day it lands.

* ``complete()`` in a fresh process reads metadata only: the bytes it reads do not grow when every
  data file of every output grows at least 8x (past the metadata scale).
* a flipped byte in an output file is found (``zerograph status`` says ``damaged``; a bulk file:
  by the reader that would load it, or ``zerograph verify``), the output is moved aside, and the
  next run rebuilds that task and what read it, nothing else.
* a kill -9 during a family's run leaves no partial output counted as done, and no temporary
  file or folder once the rerun has finished.

A deliberately broken dummy family per contract shows each check can fail, by name."""
from __future__ import annotations

import importlib
import json
import os
import pkgutil
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import luigi
import pytest

import tasks
import workflows
from tasks.base import ZGTask, completion_pass
from tasks.integrity import METADATA_BYTES, RECORD_DIGEST, write_record
from zgcore.atomic import temp_writer

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
       "HF_HUB_OFFLINE": "1"}

# the smoke graphs: each tiny preset with its workflow, and the families only options build: the tiny
# experiment with two seeds, an out-of-domain corpus and an lr search of its blocks (SeedSummary,
# PrepareHeldOut, ScoreBlock), the local study with an lr search (ChooseLocalLR), the distillation study
# over two seeds (DistillSeedsReport), the objective study (ObjectiveStudyReport), the GGUF export (ExportGGUF)
SMOKE = {
    "tiny": ("RunExperiment", "tiny", ""),
    "heal_topk_tiny": ("RunExperiment", "heal_topk_tiny", ""),
    "distill_tiny": ("DistillStudy", "distill_tiny", ""),
    "library_tiny": ("SelectStudent", "library_tiny", ""),
    "local_tiny": ("LocalLearningStudy", "local_tiny", ""),
    "tiny_seeds": ("RunExperiment", "tiny", 'seeds=[0,1] eval.extra=["stdlib-docstrings"] eval.max_sequences=4 '
                                            'train.max_steps=4 train.lrs=[1e-3,3e-3] train.lr_rounds=1'),
    "local_lrs": ("LocalLearningStudy", "local_tiny", "study.K=[1] study.aux=[mlp] study.mtp=[off] study.lrs=[1e-3,4e-3] "
                                                      "study.lr_rounds=1"),
    "distill_seeds": ("DistillStudy", "distill_tiny", "seeds=[0,1] eval.max_sequences=6"),
    "study": ("ObjectiveStudy", "tiny", "train.max_steps=2"),
    "export": ("ExportStudent", "tiny", ""),  # ExportGGUF: the tiny student as GGUF (f32, no llama.cpp needed)
}


def discover_families() -> dict[str, type[ZGTask]]:
    """Every concrete task family: the ``ZGTask`` subclasses, after importing every module of ``tasks``
    and ``workflows``, whose name does not start with ``_``."""
    for pkg in (tasks, workflows):
        for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            importlib.import_module(m.name)
    out, todo = {}, [ZGTask]
    while todo:
        for c in todo.pop().__subclasses__():
            todo.append(c)
            if not c.__name__.startswith("_") and c.__module__.split(".")[0] in ("tasks", "workflows"):
                out[c.get_task_family()] = c
    return out


def smoke_root(name: str, outputs: Path | str):
    cls, preset, over = SMOKE[name]
    return getattr(workflows, cls)(preset=preset, set=over, outputs=str(outputs))


def full_walk(root) -> list:
    """``root``'s graph, dependencies first, with the tasks a run ``yield`` s once they can be named
    (:meth:`ZGTask.dynamic_upstream`: an lr search's candidates and their scores)."""
    from workflows.cli import walk

    out, seen = [], set()

    def visit(t):
        if t.task_id in seen:
            return
        seen.add(t.task_id)
        for u in t.read_upstream() if isinstance(t, ZGTask) else []:
            visit(u)
        out.append(t)
    for t in walk(root):
        visit(t)
    return out


def graph_tasks(outputs: Path | str) -> dict[str, list[ZGTask]]:
    """Every task of every smoke graph under ``outputs`` (deps first), by smoke graph."""
    return {name: full_walk(smoke_root(name, outputs)) for name in SMOKE}


def by_family(graphs: dict[str, list[ZGTask]]) -> dict[str, list[ZGTask]]:
    out: dict[str, dict[str, ZGTask]] = {}
    for ts in graphs.values():
        for t in (t for t in ts if isinstance(t, ZGTask)):
            out.setdefault(t.get_task_family(), {})[t.task_id] = t
    return {f: list(v.values()) for f, v in out.items()}


# one run of ``{roots}`` (an expression of this module's names; ``OUT``: the outputs folder), each task in a
# process of its own (Luigi's force_multiprocessing), so that a task killed there fails alone and the others go on
KILL_EACH = """
import sys, luigi
from tests.test_contract_families import *
discover_families()
warm_imports()
luigi.configuration.get_config().set("worker", "force_multiprocessing", "true")
OUT = sys.argv[1]
sys.exit(0 if luigi.build({roots}, local_scheduler=True, log_level="WARNING") else 1)
"""


def warm_imports() -> None:
    """Import what tasks import when they run (every zgcore module, transformers' models, h5py), so that
    each task's forked process inherits it instead of importing it again."""
    import h5py  # noqa: F401
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import zgcore

    for m in pkgutil.walk_packages(zgcore.__path__, "zgcore."):
        importlib.import_module(m.name)
    for name in ("LlamaForCausalLM", "LlamaConfig", "PreTrainedTokenizerFast"):
        getattr(transformers, name)


def kill_each_family(outputs: Path, roots: str, max_rounds: int = 25) -> dict[str, object]:
    """Build ``roots`` into ``outputs`` with every family's first build SIGKILLed once its files are
    written, before the rename (``tasks.integrity.KILL_ENV``), rerunning until a run succeeds; after
    each run every task of a family just killed that says it is complete must be whole (every file's
    SHA-256). Returns
    ``{"killed": families killed, "unwhole": ["family: problem"], "rounds", "temporaries": left after
    the last run}``. Raises AssertionError when a run fails without killing a family (a real failure)."""
    from tasks.integrity import KILL_ENV
    from zgcore import hashing

    marks = outputs.with_name(outputs.name + "-killed")
    marks.mkdir(parents=True, exist_ok=True)
    script, env, unwhole = KILL_EACH.format(roots=roots), {**ENV, KILL_ENV: str(marks)}, []
    rounds = 0
    for _ in range(max_rounds):
        rounds += 1
        before = set(os.listdir(marks))
        r = subprocess.run([sys.executable, "-c", script, str(outputs)], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=900)
        hashing._SHA256_SEEN.clear()
        graph, now = eval(roots, {**globals(), "OUT": str(outputs)}), set(os.listdir(marks)) - before  # noqa: S307
        for t in {t.task_id: t for root in graph for t in full_walk(root) if isinstance(t, ZGTask)}.values():
            if t.get_task_family() in now and t.complete():
                problem = t.check_output() or t.content_problem(deep=True)
                if problem:
                    unwhole.append(f"{t.get_task_family()}: {problem}")
        if r.returncode == 0:
            break
        assert now, f"a run failed and killed no family:\n{r.stderr[-3000:]}"
    return {"killed": set(os.listdir(marks)), "unwhole": unwhole, "rounds": rounds, "temporaries": temporaries(outputs)}


KILLS: dict[str, object] = {}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every smoke graph run into one outputs folder (each preset's shared inputs built once), every
    family killed once on the way (:func:`kill_each_family`: the kill contract, checked below)."""
    out = tmp_path_factory.mktemp("smoke")
    t0 = time.perf_counter()
    KILLS.update(kill_each_family(out, "[smoke_root(n, OUT) for n in SMOKE]"), seconds=time.perf_counter() - t0)
    assert not KILLS["unwhole"], KILLS["unwhole"]
    return out


def test_every_family_is_built_by_a_smoke_graph(built):
    families = discover_families()
    seen = by_family(graph_tasks(built))
    missing = sorted(set(families) - set(seen))
    assert not missing, f"task families no smoke graph builds (add a tiny preset or an override to SMOKE): {missing}"


# -- (a) complete() reads metadata only ---------------------------------------------------------------------

def _records(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*.json")]


def grow(outputs: Path, factor: int = 8) -> None:
    """Make every recorded data file of every output under ``outputs`` at least ``factor`` times
    larger and larger than :data:`METADATA_BYTES` (sparse: zeros appended), and rewrite the sizes
    their records give (``task.json``'s ``files``; ``{"name", "bytes"}`` entries of shard records
    and manifests, whose own size and SHA-256 ``task.json`` then records anew), so that every size
    check still passes. JSON files are metadata and keep their size."""
    from zgcore.hashing import file_sha256

    recs = {rec.parent: json.loads(rec.read_text()) for rec in outputs.rglob("task.json")}
    new: dict[Path, int] = {}
    for folder, info in recs.items():
        for name, size in info.get("files", {}).items():
            f = folder / name
            if f.suffix != ".json" and f.is_file():
                want = max(size * factor, METADATA_BYTES + 1)
                os.truncate(f, want)
                info["files"][name] = new[f.resolve()] = want

    def fix(obj, here: Path) -> bool:
        changed = False
        if isinstance(obj, dict):
            here = here / obj["dir"] if isinstance(obj.get("dir"), str) else here
            if isinstance(obj.get("name"), str) and isinstance(obj.get("bytes"), int):
                p = (here / obj["name"]).resolve()
                if p in new and obj["bytes"] != new[p]:
                    obj["bytes"], changed = new[p], True
            for v in obj.values():
                changed |= fix(v, here)
        elif isinstance(obj, list):
            for v in obj:
                changed |= fix(v, here)
        return changed
    for folder, info in recs.items():
        for name in list(info.get("files", {})):
            f = folder / name
            if f.suffix == ".json" and f.is_file():
                data = json.loads(f.read_text())
                if fix(data, f.parent):
                    f.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
                    info["files"][name] = f.stat().st_size
                    if name in info.get("sha256", {}):
                        info["sha256"][name] = file_sha256(f)
        if (folder / RECORD_DIGEST).is_file():
            write_record(folder, json.dumps(info, indent=2, sort_keys=True) + "\n")
        else:
            (folder / "task.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


MEASURE = """
import json, sys
from tests.test_contract_families import *
def rchar():
    return int(next(l.split()[1] for l in open('/proc/self/io') if l.startswith('rchar')))
discover_families()
OUT = sys.argv[1]
graphs = {graphs}
out = {{}}
seen = set()
for ts in graphs.values():
    for t in ts:
        if t.task_id in seen or not isinstance(t, ZGTask):
            continue
        seen.add(t.task_id)
        a = rchar()
        ok = t.complete()
        n = rchar() - a
        fam = t.get_task_family()
        out[fam] = max(out.get(fam, 0), n)
        assert ok or not {strict}, f"{{fam}} {{t.out_dir}} is not complete"
print(json.dumps(out))
"""


def complete_bytes(outputs: Path, graphs: str = "graph_tasks(OUT)", strict: bool = True) -> dict[str, int]:
    """Per family, the most bytes one task's ``complete()`` reads (``rchar``: every byte read, page
    cache or not), in a fresh process; ``graphs`` an expression of the tasks by graph (``OUT``: the
    outputs folder); ``strict``: each must be complete."""
    r = subprocess.run([sys.executable, "-c", MEASURE.format(graphs=graphs, strict=strict), str(outputs)], cwd=ROOT,
                       env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def check_complete_reads_metadata(small: dict[str, int], large: dict[str, int], slack: int = 16 * 1024) -> None:
    """Raises AssertionError naming each family whose ``complete()`` read more at the large size."""
    grew = {f: (small[f], large[f]) for f in small if large.get(f, 0) > small[f] + slack}
    assert not grew, f"complete() reads grow with the output (bytes at 1x, at >= 8x), by family: {grew}"


def test_complete_reads_metadata_only_at_every_output_size(built, tmp_path):
    big = tmp_path / "big"
    shutil.copytree(built, big, symlinks=True)
    grow(big)
    small, large = complete_bytes(built), complete_bytes(big)
    assert set(small) == set(large) and "TeacherLogits" in small and "PrepareTeacher" in small
    check_complete_reads_metadata(small, large)


# -- (b) a flipped byte is found, never used, and only that task is rebuilt -------------------------------------

def closure_downstream(ts: list[ZGTask], target: ZGTask) -> set[str]:
    hit = {target.task_id}
    for t in ts:  # deps first
        if isinstance(t, ZGTask) and any(u.task_id in hit for u in t.read_upstream()):
            hit.add(t.task_id)
    return hit


def flip(f: Path, at: float = 0.5) -> None:
    raw = bytearray(f.read_bytes())
    raw[int(len(raw) * at)] ^= 0x10
    st = f.stat()
    f.write_bytes(bytes(raw))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same size and modification time: only the content differs


def find_damage(t: ZGTask, f: Path, graph: list[ZGTask]) -> str:
    """How the damage to ``f`` (a file of ``t``'s output) is found: ``"status"`` (``zerograph
    status`` says damaged), ``"reader"`` (a task that reads ``t`` fails naming ``f`` before its run,
    one line) or ``"verify"`` (``zerograph verify`` names it); ``t``'s folder is then moved aside.
    Raises AssertionError naming the family when nothing finds it."""
    from tasks.base import DamagedOutputError
    from workflows.cli import task_state
    from workflows.verify import verify
    from zgcore import hashing

    hashing._SHA256_SEEN.clear()  # as a fresh process (zerograph status) sees it
    if task_state(t) == "damaged":
        t.move_aside("damaged")
        return "status"
    for reader in (r for r in graph if isinstance(r, ZGTask)):
        if t in reader.read_upstream():
            try:
                reader.check_inputs()
            except DamagedOutputError as e:
                assert str(f.relative_to(t.out_dir)) in str(e) and len(str(e).splitlines()) == 1, str(e)
                assert not t.out_dir.exists()
                return "reader"
            break
    _, problems = verify([t], bar=False)
    assert any(Path(p).resolve() == f.resolve() for p, _ in problems) and not t.out_dir.exists(), \
        f"task family {t.get_task_family()!r}: a flipped byte in {f} is found by nothing"
    return "verify"


def check_flips(graphs: dict[str, list[ZGTask]], families, rng: random.Random, rerun=None, rerun_up_to: int = 3,
                pick=None) -> dict[str, str]:
    """For each family, one task and one of its files (seeded sample: its largest file or any), a
    flipped byte: found (:func:`find_damage`), and what the next run would rebuild is that task and
    what read it (the incomplete tasks of its graph), nothing else. Where that is at most
    ``rerun_up_to`` tasks, ``rerun(graph name)`` runs the graph and returns the ids of what ran,
    which must be those; elsewhere the damaged folder is put back, its byte flipped back. ``pick``:
    chooses the file instead of the sample. Returns how each damage was found."""
    how = {}
    every = list({t.task_id: t for g in graphs.values() for t in g}.values())  # each graph deps first
    for fam in families:
        name, graph = next((n, g) for n, g in graphs.items() if any(t.get_task_family() == fam for t in g))
        t = next(t for t in graph if t.get_task_family() == fam)
        files = sorted(p for p in t.out_dir.rglob("*") if p.is_file())
        f = pick(files) if pick else max(files, key=lambda p: p.stat().st_size) if rng.random() < 0.5 else rng.choice(files)
        at = rng.uniform(0.05, 0.95)
        flip(f, at)
        how[fam] = find_damage(t, f, graph)
        assert not t.out_dir.exists(), f"task family {fam!r}: the damaged output was not moved aside"
        want = closure_downstream(every, t)
        with completion_pass():  # one look at every graph (each task checked once)
            stale = {u.task_id for u in every if isinstance(u, ZGTask) and not u.complete()}
        assert stale == want, f"task family {fam!r}: a run would rebuild {sorted(stale - want)} besides {t.title()} and its readers"
        if rerun is not None and len(want) <= rerun_up_to:
            ran = set().union(*(rerun(n) for n, g in graphs.items() if any(u.task_id in want for u in g)))
            # (an output nothing reads any more, as a finished lr search's candidate score, need not be rebuilt)
            assert (t.task_id in ran or want == {t.task_id}) and ran <= want, \
                f"task family {fam!r}: the rerun ran {sorted(ran - want)} too, or not {t.title()}"
        if not t.out_dir.exists():  # not rerun, or nothing needed it: put it back as it was
            aside = max(t.out_dir.parent.glob(t.out_dir.name + ".damaged-*"), key=lambda p: p.stat().st_mtime)
            aside.rename(t.out_dir)
            flip(f, at)
    return how


def test_a_flipped_byte_in_any_family_is_found_never_used_and_rebuilds_that_task_alone(built, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(built, out, symlinks=True)
    graphs = graph_tasks(out)
    families = sorted(by_family(graphs))
    ran: list[ZGTask] = []

    @luigi.Task.event_handler(luigi.Event.START)
    def record(task):
        ran.append(task)

    def rerun(name):
        ran.clear()
        assert luigi.build([smoke_root(name, out)], local_scheduler=True, log_level="WARNING")
        return {t.task_id for t in ran if isinstance(t, ZGTask)}
    how = check_flips(graphs, families, random.Random(0), rerun=rerun)
    print(how)
    assert set(how) == set(families) and "status" in how.values()


def test_a_look_at_every_graph_checks_each_task_once_however_many_paths_lead_to_it(built, monkeypatch):
    """``complete()`` asks each input, and each input its own: within one call, and within a
    :func:`tasks.base.completion_pass` (``zerograph status``), each task is checked once. Before,
    one look at the smoke graphs checked their ~200 tasks ~17,000 times."""
    graphs = graph_tasks(built)
    every = list({t.task_id: t for g in graphs.values() for t in g if isinstance(t, ZGTask)}.values())
    checked: list[str] = []
    real = ZGTask._complete
    monkeypatch.setattr(ZGTask, "_complete", lambda self: checked.append(self.task_id) or real(self))
    with completion_pass():
        assert all(t.complete() for t in every)
    assert sorted(checked) == sorted(t.task_id for t in every)
    upstream = {t.task_id: {u.task_id for u in full_walk(t) if isinstance(u, ZGTask)} for t in every}
    deepest = max(every, key=lambda t: len(upstream[t.task_id]))
    checked.clear()
    assert deepest.complete()  # outside a pass: one call, its own memory
    assert sorted(checked) == sorted(upstream[deepest.task_id]) and len(checked) > 10


# -- (c) a kill -9 leaves nothing counted as done that is not whole, and no temporary name after the rerun ------

KILLED = """
import sys, luigi
from tests.test_contract_families import *
discover_families()
OUT = sys.argv[1]
sys.exit(0 if luigi.build([{root}], local_scheduler=True, log_level="WARNING") else 1)
"""


def temporaries(outputs: Path) -> list[Path]:
    return [p for p in outputs.rglob(".*") if temp_writer(p.name) is not None]


def check_kill(outputs: Path, family: str, trigger: str, root: str, timeout_s: float = 300) -> None:
    """Start the graph ``root`` (an expression of this module's names; ``OUT``: the outputs folder)
    in a process, SIGKILL it as soon as the glob ``trigger`` under ``outputs`` matches (``family``
    is writing), then: every task that says it is complete is whole (every file's SHA-256), the
    rerun succeeds, and no temporary name is left anywhere under ``outputs``."""
    from workflows.cli import walk
    from zgcore import hashing

    outputs.mkdir(parents=True, exist_ok=True)
    script = KILLED.format(root=root)
    proc = subprocess.Popen([sys.executable, "-c", script, str(outputs)], cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, hit = time.time() + timeout_s, []
    while time.time() < deadline and proc.poll() is None and not hit:
        hit = list(outputs.glob(trigger))
        time.sleep(0.003)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert hit, f"task family {family!r}: the kill did not land while it wrote ({trigger} never appeared)"
    hashing._SHA256_SEEN.clear()
    for t in walk(eval(root, {**globals(), "OUT": str(outputs)})):  # noqa: S307 (this module's own expression)
        if t.complete():
            problem = t.check_output() or t.content_problem(deep=True)
            assert not problem, f"task family {t.get_task_family()!r}: killed mid-run, counted as done but {problem}"
    again = subprocess.run([sys.executable, "-c", script, str(outputs)], cwd=ROOT, env=ENV, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    left = temporaries(outputs)
    assert not left, f"task family {family!r}: killed mid-run, the rerun left temporary names: {left}"


# the families of the tiny experiment, and where each writes first: a seeded sample of them is killed
KILL_POINTS = {
    "PrepareTeacher": "teachers/.tiny-llama.tmp-*",
    "PrepareCorpus": "PrepareCorpus/.*.tmp-*",
    "BoundaryShard": "BoundaryShard/.*.tmp-*",
    "TeacherBoundary": "TeacherBoundary/.*.tmp-*",
    "TrainBlock": "TrainBlock/*.partial/.checkpoint.pt.tmp-*",
    "Assemble": "Assemble/.*.tmp-*",
    "Evaluate": "Evaluate/.*.tmp-*",
}


@pytest.mark.parametrize("family", ["PrepareTeacher", "TrainBlock"])
def test_a_kill_during_a_family_leaves_nothing_partial_counted_and_no_temporary_after_the_rerun(family, tmp_path):
    """Mid-write kills where a family writes first: PrepareTeacher (a kill while the tiny teacher was
    built left ``teachers/.tiny-llama.tmp-…`` behind after a successful rerun: the sweep looked only
    beside the task's folder and in its work folder) and TrainBlock (a checkpoint in its ``.partial``
    folder). Every family is killed at its rename in the next test."""
    check_kill(tmp_path, family, KILL_POINTS[family], "smoke_root('tiny', OUT)")


def kill_problems(families: set[str], kills: dict[str, object]) -> list[str]:
    """What :func:`kill_each_family`'s record ``kills`` breaks of the kill contract over ``families``."""
    never = sorted(families - kills["killed"])
    return ([f"task families never killed: {never}"] if never else []) \
        + [f"killed mid-run, counted as done but {p}" for p in kills["unwhole"]] \
        + ([f"the reruns left temporary names: {kills['temporaries']}"] if kills["temporaries"] else [])


def test_a_kill_of_every_family_leaves_nothing_partial_counted_and_no_temporary_after_the_rerun(built):
    families = set(by_family(graph_tasks(built)))
    assert kill_problems(families, KILLS) == []
    print(f"{len(families)} families killed in {KILLS['rounds']} runs, {KILLS['seconds']:.0f} s")


class BrokenNoKillPoint(ZGTask):
    """A family that writes its final folder itself, not through ``building()``: nothing can kill it there."""

    def own_config(self):
        return {}

    def complete(self):
        return self.out_dir.is_dir()

    def run(self):
        self.out_dir.mkdir(parents=True)
        (self.out_dir / "data.bin").write_bytes(b"x" * 1000)


def test_a_family_the_kill_never_reaches_fails_the_kill_contract_by_name(tmp_path):
    kills = kill_each_family(tmp_path / "o", "[BrokenNoKillPoint(outputs=OUT)]")
    assert kill_problems({"BrokenNoKillPoint"}, kills) == ["task families never killed: ['BrokenNoKillPoint']"]


# -- broken dummies: one per contract, each failing it by name ---------------------------------------------------

class BrokenHashesAll(ZGTask):
    """A family whose ``complete()`` hashes every byte of its output (what the top-k logit store did)."""

    def own_config(self):
        return {}

    def complete(self):
        return self.out_dir.is_dir() and self.content_problem(deep=True) is None

    def run(self):
        with self.building() as tmp:
            (tmp / "data.bin").write_bytes(bytes(range(256)) * 512)


class BrokenUnchecked(ZGTask):
    """A family that records no check of its data and whose readers check nothing."""

    content_hashes = False

    def own_config(self):
        return {}

    def run(self):
        with self.building() as tmp:
            (tmp / "data.bin").write_bytes(bytes(range(256)) * 512)


class BrokenNotAtomic(ZGTask):
    """A family that writes into its final folder and calls it done when the folder exists."""

    def own_config(self):
        return {}

    def complete(self):
        return self.out_dir.is_dir()

    def run(self):
        self.out_dir.mkdir(parents=True)
        (self.out_dir / "part1.bin").write_bytes(b"x" * 1000)
        time.sleep(60)
        (self.out_dir / "part2.bin").write_bytes(b"y" * 1000)


def test_a_broken_dummy_family_fails_each_contract_by_name(tmp_path):
    # (a) complete() that hashes the whole output
    a = BrokenHashesAll(outputs=str(tmp_path / "a"))
    assert luigi.build([a], local_scheduler=True, log_level="WARNING")
    big = tmp_path / "a-big"
    shutil.copytree(tmp_path / "a", big)
    grow(big)
    spec = "{'a': [BrokenHashesAll(outputs=OUT)]}"
    small, large = complete_bytes(tmp_path / "a", spec, strict=False), complete_bytes(big, spec, strict=False)
    with pytest.raises(AssertionError, match="BrokenHashesAll"):
        check_complete_reads_metadata(small, large)
    # (b) a flipped byte nothing finds
    b = BrokenUnchecked(outputs=str(tmp_path / "b"))
    assert luigi.build([b], local_scheduler=True, log_level="WARNING")
    with pytest.raises(AssertionError, match="task family 'BrokenUnchecked'"):
        check_flips({"b": [b]}, ["BrokenUnchecked"], random.Random(0), pick=lambda files: b.out_dir / "data.bin")
    # (c) a kill mid-write leaves a partial folder counted as done
    with pytest.raises(AssertionError, match="task family 'BrokenNotAtomic'"):
        check_kill(tmp_path / "c", "BrokenNotAtomic", "BrokenNotAtomic/*/part1.bin", "BrokenNotAtomic(outputs=OUT)", timeout_s=60)


class _Written(ZGTask):
    """A family with one small file."""

    def own_config(self):
        return {}

    def run(self):
        with self.building() as tmp:
            (tmp / "small.json").write_text("{}")


def test_an_unreadable_output_in_complete_is_one_line(tmp_path, caplog, monkeypatch):
    """An errno OSError while complete() hashes an output is one line in Luigi's log naming the task,
    the folder and the error (was: Luigi's "error in complete() method" with the whole traceback),
    and the folder is kept."""
    import errno
    import logging

    import tasks.base as base

    w = _Written(outputs=str(tmp_path))
    assert luigi.build([w], local_scheduler=True, log_level="WARNING")

    def eio(path):
        raise OSError(errno.EIO, "Input/output error", str(path))
    monkeypatch.setattr(base, "file_sha256_cached", eio)
    monkeypatch.delenv("ZG_TRACEBACK", raising=False)
    with caplog.at_level(logging.WARNING, logger="luigi-interface"):
        assert not luigi.build([_Written(outputs=str(tmp_path))], local_scheduler=True, log_level="WARNING")
    lines = [r.getMessage() for r in caplog.records if "could not be read" in r.getMessage()]
    assert lines and all(len(m.splitlines()) == 1 and "Traceback" not in m for m in lines), lines
    assert "_Written" in lines[0] and "Input/output error" in lines[0] and str(w.out_dir) in lines[0]
    assert w.out_dir.is_dir() and not list(tmp_path.glob("_Written/*.damaged-*"))  # not damage: kept


class _ReadsWritten(ZGTask):
    """Reads :class:`_Written`'s file."""

    def own_config(self):
        return {}

    def requires(self):
        return _Written(outputs=self.outputs)

    def run(self):
        with self.building() as tmp:
            (tmp / "copy.json").write_text((self.requires().out_dir / "small.json").read_text())


def test_every_family_checks_what_it_reads_before_its_run():
    """Every family's run starts with ZGTask.check_inputs (wrapped when the class is defined, a
    mixin's run included), so a reader never loads an input whose bytes changed."""
    unchecked = sorted(f for f, c in discover_families().items() if not getattr(c.run, "checks_inputs", False))
    assert not unchecked, f"task families whose run does not check its inputs first: {unchecked}"


def test_a_long_lived_worker_sees_a_corruption_that_kept_size_mtime_and_inode(tmp_path):
    """complete() in a process that hashed a file once trusts its cache (path, size, mtime, inode):
    a corruption that keeps all four is not seen there; the reader's check before its run hashes
    the file anew, fails in one line naming it, and moves the output aside."""
    from tasks.base import DamagedOutputError

    w = _Written(outputs=str(tmp_path))
    assert luigi.build([w], local_scheduler=True, log_level="WARNING")
    assert w.complete()  # hashed, and cached in this process
    f = w.out_dir / "small.json"
    st = f.stat()
    with open(f, "r+b") as h:  # same inode, same size
        h.write(b"[]")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert w.complete()  # what is not re-checked: the per-process cache of complete() (docs/reliability.md)
    with pytest.raises(DamagedOutputError) as e:
        _ReadsWritten(outputs=str(tmp_path)).run()
    assert len(str(e.value).splitlines()) == 1 and "small.json" in str(e.value)
    assert not w.out_dir.exists() and list(tmp_path.glob("_Written/*.damaged-*"))
