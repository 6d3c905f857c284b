"""README.md and docs/*.md followed literally: every `.venv/bin/luigi` / `.venv/bin/zerograph` command in
their fenced bash blocks, pasted into a shell at the repository root. Cheap ones run for real on the tiny
preset (`--preset tiny` added when the command names none; a SmolLM2 preset replaced by its tiny twin);
the studies are built as Luigi builds them from the command line (their own tests run them); commands for
a cluster, a GPU or a file the reader writes first are left out, as are install commands and
`zerograph slurm` (tests/test_slurm.py runs those against a real Slurm). The README's own-model example
runs on a tiny model folder and text files made here; its workflows table is checked against the
workflows the package exports and the presets it ships."""
import json
import tomllib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
SKIP = ("SCHEDHOST", "device=cuda", "--config", "/shared/", "/data/", "/path/", "zerograph slurm")  # /path/: the reader's own files (test_own_model_and_text_as_written)
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


def _takes_preset(cmd: list[str]) -> bool:
    """Whether ``cmd`` takes ``--preset``: every ``luigi`` workflow does; a ``zerograph`` subcommand
    does when its own options say so (``zerograph clean`` works on a whole outputs folder)."""
    if not cmd[0].endswith("zerograph") or len(cmd) < 2:
        return True
    import typer.main

    from workflows.cli import app

    sub = typer.main.get_command(app).commands.get(cmd[1])
    return sub is None or any("--preset" in p.opts for p in sub.params)


def _tiny(cmd: list[str]) -> list[str]:
    if not _takes_preset(cmd):
        return cmd
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


MAX_README_WORDS = 1000
PRESETS = ROOT / "workflows" / "presets"


def readme_words() -> int:
    """Words of README.md as ``wc -w`` counts them (code, tables and links included)."""
    return len((ROOT / "README.md").read_text().split())


def workflow_classes() -> dict[str, type]:
    """Every registered workflow (:func:`workflows.registry.all_workflows`) by name, as its Luigi task
    class: what the README's table must list, no more and no less."""
    import workflows
    from workflows import registry

    return {wf.name: getattr(workflows, wf.name) for wf in registry.all_workflows()}


def workflows_table(text: str) -> dict[str, dict[str, object]]:
    """The README's ``## Workflows`` table: per workflow, ``tiny`` and ``real`` (lists of presets; None for
    "(default)", the workflow's own default) and ``docs`` (the pages its row links)."""
    section = text.split("## Workflows", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`(\w+)`", cells[0]) if len(cells) == 5 else None
        if m:
            presets = [lambda c=c: [None] * c.count("(default)") + re.findall(r"--preset (\w+)", c) for c in cells[2:4]]
            rows[m[1]] = {"tiny": presets[0](), "real": presets[1](), "docs": re.findall(r"\]\((docs/[^)#]+)", cells[4])}
    return rows


def is_tiny(preset: str) -> bool:
    """Whether a preset runs on a tiny random model (its teacher or tokenizer is a ``tiny-*`` one)."""
    if not (PRESETS / f"{preset}.toml").is_file():
        return False
    cfg = tomllib.loads((PRESETS / f"{preset}.toml").read_text())
    return str(cfg.get("teacher", cfg.get("tokenizer", ""))).startswith("tiny-")


def _registered_tiny(name: str) -> str | None:
    """The tiny preset the registry gives workflow ``name`` (None for a name it does not know)."""
    from workflows import registry

    return registry.get(name).tiny if name in registry.names() else None


def check_workflows_table(text: str, classes: dict[str, type]) -> list[str]:
    """What is wrong with README ``text``'s workflows table against ``classes`` and the shipped presets."""
    rows, wrong = workflows_table(text), []
    if set(rows) != set(classes):
        wrong.append(f"rows {sorted(rows)} != workflows {sorted(classes)}")
    for name, row in rows.items():
        default = classes[name].preset._default if name in classes else None
        tiny = [p or default for p in row["tiny"]]
        real = [p or default for p in row["real"]]
        for p in tiny + real:
            if not (PRESETS / f"{p}.toml").is_file():
                wrong.append(f"{name}: no preset {p}")
        if not tiny or not real or not all(map(is_tiny, filter(None, tiny))) or any(map(is_tiny, filter(None, real))):
            wrong.append(f"{name}: tiny {tiny} must be tiny presets, real {real} not")
        own = _registered_tiny(name)
        if own and own not in tiny:
            wrong.append(f"{name}: tiny {tiny} must name its registered tiny preset {own}")
        if not row["docs"] or not all((ROOT / d).is_file() for d in row["docs"]):
            wrong.append(f"{name}: docs {row['docs']}")
    named = set(re.findall(r"\w+", text)).union(*(re.findall(r"\w+", (ROOT / d).read_text())
                                                  for row in rows.values() for d in row["docs"]))
    wrong += [f"preset {p.stem} is named neither in README nor on a workflow's page" for p in PRESETS.glob("*.toml")
              if p.stem not in named]
    return wrong


def test_readme_is_a_guide_with_every_workflow():
    """Under 1,000 words; a table row for every workflow the package exports, with a tiny and a real
    preset that exist and a docs page; every shipped preset named in README or on its workflow's page."""
    text = (ROOT / "README.md").read_text()
    assert readme_words() < MAX_README_WORDS, f"README has {readme_words()} words"
    assert check_workflows_table(text, workflow_classes()) == []
    for section in ("## Install", "## One minute", "## The default experiment", "## Workflows",
                    "## Your own model and your own text", "## Glossary", "## The `zerograph` command", "## Tests"):
        assert section in text, section
    for term in ("gap recovered", "gates", "context use", "boundary shift", "cache economics", "plumbing check",
                 "nats/token", "run unit"):
        assert re.search(rf"^\* \*\*[^*]*{re.escape(term)}[^*]*\*\*: ", text, re.M | re.I), f"glossary lacks {term}"
    assert "2.8646" in text and "5.0868" in text and "3.0187" in text


def test_the_workflows_check_fails_on_a_broken_table():
    """The table check can fail: a missing workflow, a tiny column naming a real preset, an unknown preset."""
    text = (ROOT / "README.md").read_text()
    classes = workflow_classes()
    assert any("rows" in w for w in check_workflows_table(text, {**classes, "BrandNewStudy": classes["RunExperiment"]}))
    broken = text.replace("| `--preset library_tiny` |", "| `--preset library` |", 1)
    assert any(w.startswith("SelectStudent: tiny") for w in check_workflows_table(broken, classes))
    broken = text.replace("`--preset local_cpu_5seed`", "`--preset local_cpu_7seed`", 1)
    assert any("no preset local_cpu_7seed" in w for w in check_workflows_table(broken, classes))


def _preset_of(cmd: list[str], classes: dict[str, type]) -> tuple[str, str] | None:
    """``(workflow, preset)`` of a ``luigi`` command (the workflow's default preset when none is named)."""
    name = next((w for w in cmd if w in classes), None)
    if name is None:
        return None
    return name, cmd[cmd.index("--preset") + 1] if "--preset" in cmd else classes[name].preset._default


def test_each_page_shows_a_workflows_tiny_twin_before_its_long_commands():
    """On README and every page of docs/, the first command of each workflow runs a tiny preset, so a
    reader meets the seconds-long twin before a command that takes minutes or hours."""
    classes = workflow_classes()
    for f in doc_files():
        first: dict[str, str] = {}
        for _, cmd in doc_commands([f]):
            got = _preset_of(cmd, classes) if cmd[0].endswith("luigi") else None
            if got and got[0] not in first:
                first[got[0]] = got[1]
                assert is_tiny(got[1]), f"{f.name}: the first {got[0]} command runs preset {got[1]!r}, not a tiny twin"


def test_own_model_and_text_as_written(tmp_path):
    """The README's "your own model and your own text" commands, with /path/hf-folder a tiny Llama folder
    and /path/*.txt three text files made here (and the tiny preset's sizes, as every README command)."""
    from zgcore.models.teacher import build_tiny

    own = [c for _, c in doc_commands([ROOT / "README.md"], skip=()) if any("/path/" in w for w in c)]
    assert [c[:2] for c in own] == [[".venv/bin/luigi", "--module"], [".venv/bin/zerograph", "report"]], own
    build_tiny("llama", tmp_path / "hf-folder")
    (tmp_path / "text").mkdir()
    for i in range(3):
        (tmp_path / "text" / f"{i}.txt").write_text(" ".join(f"word{(i * 7 + j) % 50}" for j in range(600)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    for cmd in own:
        cmd = _tiny([w.replace("/path/hf-folder", str(tmp_path / "hf-folder")).replace("/path/", f"{tmp_path}/text/")
                     for w in cmd])
        r = subprocess.run(_argv(cmd), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (cmd, (r.stdout + r.stderr)[-3000:])
        if cmd[0].endswith("luigi"):
            # the one line naming the corpus says that the tiny preset's corpus.max_tokens left files unread
            assert "[PrepareTeacher hf-folder]" in r.stdout and re.search(
                rf"^\[PrepareCorpus \S+\] corpus {re.escape(str(tmp_path))}/text/\*\.txt: 4096 tokens -> .*; corpus\.max_tokens=4096 "
                r"reached in the first [12] of 3 source file\(s\), read in name order: [12] never opened", r.stdout, re.M), r.stdout
        else:
            assert "held-out CE" in r.stdout and "hf-folder" in r.stdout, r.stdout[-2000:]
