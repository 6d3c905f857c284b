"""README.md and docs/*.md followed literally: every `.venv/bin/luigi` / `.venv/bin/zerograph` command in
their fenced bash blocks, pasted into a shell at the repository root. Cheap ones run for real on the tiny
preset (`--preset tiny` added when the command names none; a SmolLM2 preset replaced by its tiny twin);
the studies are built as Luigi builds them from the command line (their own tests run them); commands for
a cluster, a GPU or a file the reader writes first are left out, as are install commands and
`zerograph slurm` (tests/test_slurm.py runs those against a real Slurm)."""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
SKIP = ("SCHEDHOST", "device=cuda", "--config", "/shared/", "/data/", "zerograph slurm")
ENV_VAR = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def doc_files() -> list[Path]:
    """README.md, then every page of docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def doc_commands(files: list[Path] | None = None, skip: tuple[str, ...] = SKIP) -> list[tuple[dict[str, str], list[str]]]:
    """``(environment variables, argv)`` of every luigi / zerograph command line of ``files`` (default:
    :func:`doc_files`), in order, leaving out lines containing a ``skip`` string; a leading ``VAR=value``
    belongs to the environment."""
    cmds = []
    for f in files or doc_files():
        for block in re.findall(r"```bash\n(.*?)```", f.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True) if line.strip() else []
                env = {}
                while words and ENV_VAR.match(words[0]):
                    k, v = words.pop(0).split("=", 1)
                    env[k] = v
                if words and words[0] in (".venv/bin/luigi", ".venv/bin/zerograph") and not any(s in line for s in skip):
                    cmds.append((env, words))
    return cmds


def readme_commands() -> list[list[str]]:
    """Every luigi / zerograph command line of README.md, none left out."""
    return [c for _, c in doc_commands([ROOT / "README.md"], skip=())]


def test_docs_name_the_venv_for_every_command():
    for f in doc_files():
        for block in re.findall(r"```bash\n(.*?)```", f.read_text(), re.S):
            for line in block.splitlines():
                assert not re.match(r"\s*([A-Z_]+=\S+ )*(luigi|zerograph|luigid|pip|python) ", line), \
                    f"bare command in {f.name}: {line}"
    assert len(doc_commands()) >= 15


def test_readme_is_a_front_door():
    """At most 250 lines; after the install command, the first command is the one-minute tiny run."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    first = readme_commands()[0]
    assert first[:4] == [".venv/bin/luigi", "--module", "workflows", "RunExperiment"] and "--preset" in first
    assert first[first.index("--preset") + 1] == "tiny"
    assert [".venv/bin/zerograph", "report", "--preset", "tiny"] in readme_commands()
    for page in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / page).is_file(), f"README links to a missing page {page}"
    linked = set(re.findall(r"\]\(docs/([^)#]+\.md)", text))
    assert linked >= {p.name for p in (ROOT / "docs").glob("*.md")}, "the README's map of docs/ misses a page"


def _argv(cmd: list[str]) -> list[str]:
    prog, args = Path(cmd[0]).name, cmd[1:]
    if prog == "luigi":
        return [sys.executable, "-m", "luigi", *args]
    return [sys.executable, "-c", "import sys; from workflows.cli import main; sys.argv[0] = 'zerograph'; main()", *args]


TINY_OF = {"distill": "distill_tiny", "library": "library_tiny", "heal_topk": "heal_topk_tiny", "convert": "convert_tiny",
           "convert_study": "convert_study_tiny", "convert_library": "convert_library_tiny"}  # a SmolLM2 preset -> its seconds-long twin on a tiny random teacher


def _tiny(cmd: list[str]) -> list[str]:
    if "--preset" in cmd:
        i = cmd.index("--preset") + 1
        return [*cmd[:i], TINY_OF.get(cmd[i], cmd[i]), *cmd[i + 1:]]
    return cmd + ["--preset", "local_tiny" if "LocalLearningStudy" in cmd else "tiny"]


def _fit_tiny(cmd: list[str]) -> list[str]:
    """The README's widths are SmolLM2's (MLP 1536); the tiny teachers' MLPs are 64 wide, so an
    `intermediate_size` is scaled to the same fraction of 64 and the command still runs the width path."""
    return [re.sub(r"intermediate_size=(\d+)", lambda m: f"intermediate_size={max(1, int(m[1]) * 64 // 1536)}", a)
            for a in cmd]


def test_doc_commands_work_as_written(tmp_path):
    """Every command in README order, then docs/ in name order; the `luigi` commands first, so that a
    `zerograph` command reads what they built (as a reader of the docs would have run). A command
    that appears again word for word (after the tiny preset is put in) runs once: rerunning a finished
    command is the graph's own business (tests/test_graph.py). The studies are built in one process,
    each from its own command line, as Luigi builds them."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    work = tmp_path / "clone"
    work.mkdir()
    (work / "luigi.cfg").write_text((ROOT / "luigi.cfg").read_text())
    ran, studies, seen = [], [], set()
    for extra, cmd in sorted(doc_commands(), key=lambda c: c[1][0].endswith("zerograph")):
        cmd = _fit_tiny(_tiny(cmd))
        if (key := (tuple(sorted(extra.items())), tuple(cmd))) in seen:
            continue
        seen.add(key)
        if "ObjectiveStudy" in cmd or "LocalLearningStudy" in cmd:  # built below; run by test_study / test_local
            studies.append((extra, cmd[1:]))
            continue
        r = subprocess.run(_argv(cmd), cwd=work, env={**env, **extra}, capture_output=True, text=True, timeout=600)
        # every command exits 0; `zerograph status --set "blocks.1.lr=1e-4"` finds everything done because
        # docs/config-guide.md's `--set "blocks.1.lr=1e-4 train.epochs=1"` built that very block (max_steps is set on
        # the tiny preset, so epochs takes no effect and is not hashed: only effective settings are hashed)
        assert r.returncode == 0, (cmd, (r.stdout + r.stderr)[-3000:])
        if cmd[:2] == [".venv/bin/zerograph", "status"] and "blocks.1.lr=1e-4" in " ".join(cmd):
            assert " missing " not in r.stdout and " stale " not in r.stdout and "TrainBlock block1" in r.stdout, r.stdout
        if cmd[0].endswith("luigi"):  # every run ends with its report's path
            assert re.search(r"^Report: \S+/report\.md$", r.stdout + r.stderr, re.M), (cmd, r.stdout[-2000:])
        ran.append(cmd)
    assert any("report" in c for c in ran) and sum(c[0].endswith("luigi") for c in ran) >= 6
    assert any("DistillStudy" in c for c in ran)
    code = ("import json, os, sys, workflows; from luigi.cmdline_parser import CmdlineParser\n"
            "base = dict(os.environ)\n"
            "for extra, argv in json.loads(sys.argv[1]):\n"
            "    os.environ.clear(); os.environ.update({**base, **extra})  # each command's own VAR=value\n"
            "    with CmdlineParser.global_instance(argv) as cp: t = cp.get_task_obj(); assert t.requires(), argv\n"
            "print('built', len(json.loads(sys.argv[1])))")
    r = subprocess.run([sys.executable, "-c", code, json.dumps(studies)], cwd=work, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.split() == ["built", str(len(studies))], r.stderr[-3000:]
    assert len(studies) >= 8 and any("ObjectiveStudy" in argv for _, argv in studies)
