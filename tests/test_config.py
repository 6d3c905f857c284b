import pytest

from workflows.experiment import load_config
from zgcore.checks import ConfigError
from zgcore.config.experiment import parse_overrides, resolve
from zgcore.models.shapes import kept_layers, resolve_boundaries


def test_overrides_parse_nested_values():
    got = parse_overrides("train.lr=1e-4 blocks.1.lr=5e-5 boundary.boundaries=[0,2,4] teacher=tiny-gpt2")
    assert got == {"train": {"lr": 1e-4}, "blocks": {"1": {"lr": 5e-5}}, "boundary": {"boundaries": [0, 2, 4]},
                   "teacher": "tiny-gpt2"}


def test_file_and_overrides_merge(tmp_path):
    f = tmp_path / "exp.toml"
    f.write_text('teacher = "tiny-qwen2"\n[train]\nlr = 0.01\n[blocks.1]\nlr = 0.002\nseed = 7\n')
    cfg = resolve(f, "blocks.0.epochs=2")
    assert cfg["teacher"] == "tiny-qwen2"
    assert cfg["train"]["lr"] == 0.01
    assert cfg["blocks"] == {"1": {"lr": 0.002, "seed": 7}, "0": {"epochs": 2}}
    y = tmp_path / "exp.yaml"
    y.write_text("teacher: tiny-gpt2\nblocks:\n  1: {lr: 0.5}\n")
    assert resolve(y)["blocks"] == {"1": {"lr": 0.5}}


@pytest.mark.parametrize("over, needle", [
    ("teacher=no-such-teacher", "unknown teacher 'no-such-teacher'"),
    ("teacher=/nonexistent/model.gguf", "does not exist"),
    ("teacher=tiny-llama corpus.seq_len=32 boundary.boundaries=[0,3,2,4]", "strictly increasing"),
    ("teacher=tiny-llama corpus.seq_len=32 boundary.boundaries=[0,2,9]", "must end at the teacher's layer count 4"),
    ("teacher=tiny-llama corpus.seq_len=32 boundary.boundaries=[1,2,4]", "must start at 0"),
    ("teacher=tiny-llama corpus.seq_len=32 corpus.seq_len=4096", "exceeds the context"),
    ("teacher=tiny-llama corpus.seq_len=32 train.objective=bogus", "train.objective must be one of clean, noisy, denoise, attention_transfer, got 'bogus'"),
    ("teacher=tiny-llama corpus.seq_len=32 train.nosuchkey=1", "unknown key train.nosuchkey; known in train: "),
    ("teacher=tiny-llama corpus.seq_len=32 train.learning_rate=1e-4", "unknown key train.learning_rate: did you mean train.lr?"),
    ("teacher=tiny-llama corpus.seq_len=32 boundary.num_block=2", "unknown key boundary.num_block: did you mean boundary.num_blocks?"),
    ("teacher=tiny-llama corpus.seq_len=32 boundary.num_blocks=2 train.n_layers=3", "exceeds the partition's 2 teacher layers"),
    ("teacher=tiny-llama corpus.seq_len=32 boundary.num_blocks=2 blocks.5.lr=1", "only 2 blocks"),
    ("teacher=tiny-llama corpus.seq_len=32 train.lr=-1", "train.lr must be a number > 0, got -1"),
    ("teacher=tiny-llama corpus.seq_len=32 eval.context_window=17", "at most half of corpus.seq_len"),
    ("teacher=tiny-llama corpus.seq_len=32 train.noise=-0.5", "noise must be a number >= 0"),
    ("teacher=tiny-llama corpus.seq_len=32 train.targets=remote", "targets must be one of"),
    ("teacher=tiny-llama corpus.seq_len=32 device=gpu0", "device must be a torch device"),
    ("teacher=tiny-llama corpus.seq_len=32 corpus.source=/nonexistent/*.txt", "matches no file"),
])
def test_bad_input_fails_with_a_clear_message(over, needle):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=over, preset="")
    assert needle in str(e.value)


def test_empty_corpus_file_fails(tmp_path):
    f = tmp_path / "empty.txt"
    f.write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        load_config(overrides=f"teacher=tiny-llama corpus.seq_len=32 corpus.source={f}", preset="")


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import BertConfig

    BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="architecture 'bert'"):
        load_config(overrides=f"teacher={tmp_path}", preset="")


def test_boundaries_and_kept_layers():
    assert resolve_boundaries({"boundaries": None, "num_blocks": 3}, 30) == [0, 10, 20, 30]
    t = {"n_layers": None, "keep_fraction": 0.8, "keep": "spread"}
    assert kept_layers(10, 20, t) == [10, 11, 13, 14, 15, 16, 18, 19]
    assert kept_layers(0, 10, {**t, "keep": "first"}) == list(range(8))
    assert kept_layers(0, 4, {**t, "n_layers": 1}) == [0]


def test_a_broken_yaml_or_toml_value_is_one_line_naming_the_file_and_place(tmp_path):
    from zgcore.config.experiment import load_file

    y, t = tmp_path / "exp.yaml", tmp_path / "exp.toml"
    y.write_text("teacher: tiny-llama\ntrain:\n  lr: [1e-4\n  seed: 1\n")
    t.write_text('teacher = "tiny-llama"\n[train]\nlr = 1e-4x\nseed = 1\n')
    for f, where in ((y, "line "), (t, "line 3")):
        with pytest.raises(ConfigError) as e:
            load_file(f)
        msg = str(e.value)
        assert len(msg.splitlines()) == 1 and str(f) in msg and "does not parse" in msg and where in msg, msg
