"""Every override and input error is one line and exit 2, from `luigi` and from `zerograph status`
alike: values with spaces, YAML syntax errors, a repeated
--set (merged in order), keys named as written, presets of another workflow, corpus problems
found in file headers, an unreachable Hub; a problem found only while tokenising ends the task
with one `error:` line naming the file."""
import json

import pytest
from typer.testing import CliRunner

from tests.conftest import tiny_cfg
from tests.test_front_door import luigi_cmd, run_all
from workflows.cli import app
from zgcore.checks import ConfigError
from zgcore.config.experiment import parse_overrides


def _corpus_cases(d):
    """(name, corpus.source, the one-line message expected) for problems readable from file headers."""
    d.mkdir(exist_ok=True)
    (d / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1") * 20)
    (d / "other.txt").write_bytes("na\xefve\n".encode("latin-1") * 20)
    (d / "body.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    return [("explicit non-UTF-8 file", str(d / "latin1.txt"), "latin1.txt is not UTF-8 text (byte 0xe9 at offset 3)"),
            ("JSONL without the field", str(d / "body.jsonl"), "body.jsonl has no field 'text' in its first record"),
            ("glob of unusable files", str(d / "*.txt"), "none of the 2 matched file(s) is usable")]


def _cases(tmp_path):
    """(--set arguments, the message expected) for `luigi` and `zerograph status`."""
    cases = [(["boundary.boundaries=[0, 2, 9]"], "boundary.boundaries must end at the teacher's layer count 4, got [0, 2, 9]"),
             (["corpus.seq_len=[1"], "--set corpus.seq_len=[1: the value is not valid YAML"),
             (["train.lr=abc"], "train.lr must be a number, got 'abc'"),
             (["blocks.1.lr=abc"], "blocks.1.lr must be a number, got 'abc'"),
             (["train.lr=abc", "train.epochs=1"], "train.lr must be a number, got 'abc'"),  # the first --set is kept
             (["train.lr=0.01", "train.lr=xyz"], "train.lr must be a number, got 'xyz'")]  # a later key wins
    cases += [([f"corpus.source={src}"], msg) for _, src, msg in _corpus_cases(tmp_path / "c")]
    return cases


def _one_error_line(log, needle):
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and needle in errors[0], log[-3000:]
    assert "Traceback" not in log


def test_override_and_corpus_errors_from_luigi_are_one_line_and_exit_2(tmp_path):
    cases = _cases(tmp_path)
    out = str(tmp_path / "o")
    cmds = [luigi_cmd("--preset", "tiny", "--outputs", out, *[a for s in sets for a in ("--set", s)]) for sets, _ in cases]
    cmds.append(luigi_cmd("--preset", "local_tiny", "--outputs", out))  # a preset of another workflow
    cases.append(([], "preset 'local_tiny' belongs to LocalLearningStudy: run `luigi --module workflows LocalLearningStudy"))
    cmds.append(luigi_cmd("--preset", "tiny", "--outputs", out, "--set", "teacher=someorg/somemodel"))  # HF_HUB_OFFLINE=1
    cases.append(([], "teacher 'someorg/somemodel' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set"))
    for (code, log), (sets, needle) in zip(run_all(cmds, tmp_path), cases):
        assert code == 2, (sets, log[-3000:])
        _one_error_line(log, needle)
    assert not (tmp_path / "o").exists()  # nothing ran


def test_override_and_corpus_errors_from_zerograph_status_are_one_line_and_exit_2(tmp_path):
    for sets, needle in _cases(tmp_path):
        r = CliRunner().invoke(app, ["status", "--preset", "tiny", "--outputs", str(tmp_path / "o"),
                                     *[a for s in sets for a in ("--set", s)]])
        assert r.exit_code == 2, (sets, r.output)
        _one_error_line(r.output, needle)


def test_a_value_with_spaces_works_as_one_set_and_a_repeated_set_merges_in_order(tmp_path):
    assert parse_overrides("boundary.boundaries=[0, 2, 4] train.lr=1e-3\ntrain.lr=2e-3 name='my run'") == {
        "boundary": {"boundaries": [0, 2, 4]}, "train": {"lr": 2e-3}, "name": "my run"}
    with pytest.raises(ConfigError, match=r"--set 'c' must look like key.sub=value"):
        parse_overrides("a.b=1 c")
    r = CliRunner().invoke(app, ["status", "--preset", "tiny", "--outputs", str(tmp_path), "--set",
                                 "boundary.boundaries=[0, 1, 4]", "--set", "train.lr=abc", "--set", "train.lr=0.01"])
    assert r.exit_code == 1, r.output  # valid: nothing is built yet
    assert [line.split()[1] for line in r.output.splitlines() if line.startswith("TrainBlock")] == [
        "block0-clean-cached-s0", "block1-clean-cached-s0"]
    hint = r.output.splitlines()[-1]  # the command to run repeats every --set, in order
    assert "--set 'boundary.boundaries=[0, 1, 4]' --set train.lr=abc --set train.lr=0.01" in hint


def test_a_corpus_problem_found_while_tokenising_ends_the_task_with_one_error_line(tmp_path):
    late = tmp_path / "late.txt"
    late.write_bytes(b"hello world\n" * 6000 + "caf\xe9\n".encode("latin-1"))  # UTF-8 for the first 64 KiB
    cfg = tiny_cfg(**{"corpus.source": str(late), "corpus.max_tokens": 0})
    ((code, log),) = run_all([luigi_cmd("--preset", "", "--outputs", str(tmp_path / "o"), "--set", cfg)], tmp_path)
    assert code == 30, log[-3000:]  # a task failed (Luigi's code), its message is one line
    _one_error_line(log, f"error: PrepareCorpus corpus-T32: corpus file {late} cannot be read as text")


def test_an_unreachable_hub_fails_after_one_probe(monkeypatch):
    import time

    from huggingface_hub import constants
    import transformers

    from zgcore.models.teacher import describe

    real = transformers.AutoConfig.from_pretrained
    calls = []

    def from_pretrained(spec, **kw):
        calls.append(kw)
        assert kw.get("local_files_only"), "the Hub was asked although it is unreachable"
        return real(spec, **kw)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"someorg/somemodel' is not in the local Hugging Face cache and "
                                          r"http://127.0.0.1:9 is unreachable"):
        describe("someorg/somemodel")
    assert time.perf_counter() - t0 < 10 and len(calls) == 1
