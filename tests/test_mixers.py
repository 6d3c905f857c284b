"""Converted students: token mixers other than the teacher's attention (train.mixer), their two forms,
the exported folder that decodes in constant memory, the graph that reruns only what a mixer change
touches, and the one-line errors of a configuration that asks for the impossible."""
import json
import os
import subprocess
import sys
import types
from typing import get_args

import pytest
import torch

from tests.conftest import tiny_cfg
from zgcore.checks import ConfigError
from zgcore.config.defaults import DEFAULTS
from zgcore.config.schema import Mixer
from zgcore.models.hf_converted_llama import (MIXERS, ZGConvertedLlamaConfig, ZGConvertedLlamaForCausalLM,
                                              ZGRecurrentCache)
from zgcore.models.teacher import tiny_config
from zgcore.config.experiment import effective_train

WINDOW = 8
HYBRID = ["softmax", "linear_window", "none", "window"]


def converted(mixers, seed=0, perturb=True):
    """A tiny converted Llama; feature maps moved off the identity so the test sees them."""
    base = tiny_config("llama")
    keep = {k: v for k, v in base.to_dict().items() if k not in ("model_type", "architectures", "transformers_version")}
    torch.manual_seed(seed)
    m = ZGConvertedLlamaForCausalLM(ZGConvertedLlamaConfig(**{**keep, "layer_mixers": mixers, "mixer_window": WINDOW}))
    if perturb:
        with torch.no_grad():
            for p in m.parameters():
                if p.dim() == 3:  # the feature maps [heads, d, d]
                    p.add_(0.3 * torch.randn_like(p))
    return m.float().eval()


def test_the_mixer_choices_are_the_modelling_codes():
    assert get_args(Mixer) == MIXERS and DEFAULTS["train"]["mixer"] == "softmax"


def forms_differ(m) -> float:
    """Largest |logit| difference between the parallel form and the recurrent one (token by token,
    and a 13-token prefill then token by token) on two sequences of four windows."""
    ids = torch.randint(0, 256, (2, 4 * WINDOW), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        parallel = m(ids).logits
        cache = ZGRecurrentCache(4)
        one_by_one = torch.cat([m(ids[:, i:i + 1], cache=cache).logits for i in range(ids.shape[1])], 1)
        cache2 = ZGRecurrentCache(4)
        split = torch.cat([m(ids[:, :13], cache=cache2).logits] +
                          [m(ids[:, i:i + 1], cache=cache2).logits for i in range(13, ids.shape[1])], 1)
    assert cache.get_seq_length() == cache2.get_seq_length() == 4 * WINDOW
    return float(max((parallel - one_by_one).abs().max(), (parallel - split).abs().max()))


@pytest.mark.parametrize("mixers", [[m] * 4 for m in MIXERS] + [HYBRID], ids=[*MIXERS, "hybrid"])
def test_parallel_and_recurrent_forms_give_the_same_logits(mixers):
    assert forms_differ(converted(mixers)) <= 1e-4


def test_the_forms_check_catches_a_recurrent_form_that_drifts(monkeypatch):
    from zgcore.models.hf_converted_llama import ZGMixer

    real = ZGMixer.step
    monkeypatch.setattr(ZGMixer, "step", lambda self, state, q, k, v: real(self, state, q, k, v) * 1.01)
    assert forms_differ(converted(["linear_window"] * 4)) > 1e-4


def test_a_window_mixer_does_not_see_past_its_window():
    m = converted(["window"] * 4)
    ids = torch.randint(0, 256, (1, 5 * WINDOW))
    other = ids.clone()
    other[0, 0] = (ids[0, 0] + 1) % 256  # 4 layers reach back 4 * 7 = 28 < 39 tokens
    with torch.no_grad():
        a, b = m(ids).logits[0, -1], m(other).logits[0, -1]
    assert torch.equal(a, b)
    lin = converted(["linear"] * 4)
    with torch.no_grad():
        assert not torch.equal(lin(ids).logits[0, -1], lin(other).logits[0, -1])  # linear attention sees everything


def test_softmax_keys_leave_the_hash_and_other_mixers_enter_it():
    t = dict(DEFAULTS["train"])
    before = {k: v for k, v in t.items() if k not in ("mixer", "window")}  # the settings before mixers existed
    assert effective_train(t) == effective_train(before)
    assert effective_train({**t, "window": 3}) == effective_train(before)  # a window a softmax block never reads
    assert effective_train({**t, "mixer": "linear"})["mixer"] == "linear" and "window" not in effective_train({**t, "mixer": "linear"})
    assert effective_train({**t, "mixer": "window", "window": 3})["window"] == 3


def test_bad_mixer_settings_fail_at_graph_build_in_one_line():
    from workflows.experiment import load_config

    with pytest.raises(ConfigError, match=r"train.mixer='linear'.*'qwen3'.*families that can: llama") as e:
        load_config("", tiny_cfg("tiny-qwen3", **{"train.mixer": "linear"}))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"blocks.1.mixer='none'.*'gpt2'"):
        load_config("", tiny_cfg("tiny-gpt2", **{"blocks.1.mixer": "none"}))
    with pytest.raises(ConfigError, match=r"train.window=32 is as long as the sequence \(corpus.seq_len=32\)") as e:
        load_config("", tiny_cfg(**{"train.mixer": "linear_window", "train.window": 32}))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"train.mixer must be one of"):
        load_config("", tiny_cfg(**{"train.mixer": "mamba"}))
    load_config("", tiny_cfg(**{"train.mixer": "linear", "train.window": 32}))  # linear reads no window


def test_a_converted_block_starts_from_the_teachers_projections(tmp_path):
    from transformers import AutoModelForCausalLM

    from zgcore.models.adapters import build_block
    from zgcore.models.teacher import build_tiny

    teacher = AutoModelForCausalLM.from_pretrained(build_tiny("llama", tmp_path / "t"), dtype=torch.float32)
    soft = build_block(teacher, [1], "teacher", 0)
    lin = build_block(teacher, [1], "teacher", 0, mixer="linear")
    none = build_block(teacher, [1], "teacher", 0, mixer="none")
    sd, lsd = soft.layer_state_dict(), lin.layer_state_dict()
    assert all(torch.equal(sd[k], lsd[k]) for k in sd)
    eye = torch.eye(8).expand(4, 8, 8)
    assert torch.equal(lsd["layers.0.self_attn.feature_q"], eye) and set(lsd) - set(sd) == {
        "layers.0.self_attn.feature_q", "layers.0.self_attn.feature_k"}
    assert not any("self_attn" in k for k in none.layer_state_dict())
    h = torch.randn(2, 16, 32)
    window = build_block(teacher, [1], "teacher", 0, mixer="window", window=16)
    with torch.no_grad():  # a window as long as the sequence is the teacher's attention
        assert torch.allclose(window(h), soft(h), atol=1e-5)


# the project's packages cannot be imported, whatever installed them (an editable install adds a finder,
# not only a sys.path entry): the exported folder must load on torch and transformers alone
BLOCK_PROJECT = """
import importlib.abc, sys
class _NoProject(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("zgcore", "tasks", "workflows"):
            raise ImportError(f"{name} is the project's, not the exported folder's")
sys.meta_path.insert(0, _NoProject())
"""
LOAD_ALONE = BLOCK_PROJECT + """
import sys, json, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
ids = torch.tensor([[1, 2, 3]])
out = {}
for n in (256, 2048):
    g = m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    cache = g.cache if getattr(g, "cache", None) is not None else g.past_key_values
    out[n] = [int(g.sequences.shape[1]), cache.get_seq_length(), cache.nbytes()]
    if n == 256:  # greedy decoding on the recurrent state = argmax of the parallel form
        with torch.no_grad():
            par = m(g.sequences[:, :-1]).logits.argmax(-1)[0, 2:]
        out["greedy_matches"] = bool(torch.equal(par, g.sequences[0, 3:]))
print(json.dumps(out))
"""


def test_the_load_alone_guard_stops_an_import_of_the_project():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    importable = subprocess.run([sys.executable, "-c", "import zgcore.models.mixers"], cwd="/", env=env,
                                capture_output=True, text=True, timeout=120)
    assert importable.returncode == 0, importable.stderr[-500:]  # installed here: a sys.path check could not see it
    r = subprocess.run([sys.executable, "-c", BLOCK_PROJECT + "import zgcore.models.mixers"], cwd="/", env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "ImportError: zgcore is the project's" in r.stderr, r.stderr[-500:]


@pytest.mark.parametrize("mixer", ["window", "linear", "linear_window", "softmax"])
def test_the_exported_folder_loads_alone_and_decodes_in_constant_memory(mixer, tmp_path):
    m = converted([mixer] * 3 + ["none"], perturb=False)
    m.save_pretrained(tmp_path / "model")
    assert (tmp_path / "model" / "hf_converted_llama.py").is_file() and (tmp_path / "model" / "hf_linear_attention.py").is_file()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", LOAD_ALONE, str(tmp_path / "model")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["256"][:2] == [259, 258] and out["2048"][:2] == [2051, 2050]  # every token went through the state
    assert out["greedy_matches"]
    if mixer == "softmax":
        assert out["2048"][2] > 7 * out["256"][2]
    else:
        assert out["2048"][2] == out["256"][2] > 0


def test_changing_one_blocks_mixer_reruns_only_that_block_assembly_and_evaluation(tmp_path, run_graph):
    from transformers import AutoModelForCausalLM

    from workflows import RunExperiment

    out = str(tmp_path / "out")
    cfg = tiny_cfg(**{"train.mixer": "linear_window", "train.window": 8})
    ok, ran = run_graph(RunExperiment(preset="", set=cfg, outputs=out))
    assert ok and len(ran) == 15
    ok, ran = run_graph(RunExperiment(preset="", set=cfg + " blocks.1.mixer=softmax", outputs=out))
    assert ok
    # the untrained student changes with the block's mixer, so its score is rebuilt too; the teacher's is not,
    # and no cache task runs
    assert sorted(f for f, _ in ran if f != "RunExperiment") == ["Assemble", "BoundaryShift", "Evaluate", "ScoreAssembled",
                                                                 "ScoreUntrained", "TrainBlock"]
    assert [label for f, label in ran if f == "TrainBlock"] == ["block1-clean-cached-s0"]
    report = max((tmp_path / "out").glob("Evaluate/*/report.json"), key=lambda p: p.stat().st_mtime_ns)
    rep = json.loads(report.read_text())
    assert [b.get("mixer", "softmax") for b in rep["blocks"]] == ["linear_window", "softmax"]
    model = AutoModelForCausalLM.from_pretrained(rep["model_dir"], trust_remote_code=True)
    assert model.config.layer_mixers == ["linear_window", "softmax"] and model.config.mixer_window == 8


def test_attention_transfer_targets_are_the_same_cached_and_online_and_read_only_the_partition(tmp_path, run_graph,
                                                                                             monkeypatch):
    from pathlib import Path

    import zgcore.models.teacher_weights as tw
    from workflows import RunExperiment

    read = []
    real = tw.LazyLayers.layer_weights
    monkeypatch.setattr(tw.LazyLayers, "layer_weights", lambda self, i: read.append(i) or real(self, i))
    over = {"train.mixer": "linear_window", "train.window": 8, "train.objective": "attention_transfer",
            "train.transfer_steps": 3, "train.prefetch": 0}
    for targets in ("cached", "online"):
        ok, ran = run_graph(RunExperiment(preset="", outputs=str(tmp_path), set=tiny_cfg(**over, **{"train.targets": targets})))
        assert ok
    files = {p.parent.name.split("-")[0] + "-" + p.parent.name.split("-")[3]: p.read_bytes()
             for p in Path(tmp_path).glob("TrainBlock/*/block.safetensors")}
    assert sorted(files) == ["block0-cached", "block0-online", "block1-cached", "block1-online"]
    assert files["block0-cached"] == files["block0-online"] and files["block1-cached"] == files["block1-online"]
    # each block read its kept layer and its partition's two teacher layers, nothing else (per mode); the
    # untrained student's score (one for both modes) read the kept layers once more
    assert sorted(read) == sorted([0, 0, 1, 2, 2, 3] * 2 + [0, 2])
    log = (next(Path(tmp_path).glob("TrainBlock/block1-*cached*/loss_log.csv"))).read_text().splitlines()
    losses = [float(r.split(",")[1]) for r in log[1:]]
    assert max(losses[:3]) < min(losses[3:]) / 100  # transfer MSE first, then the (larger) boundary regression


def test_attention_transfer_with_nothing_to_transfer_fails_in_one_line():
    from workflows.experiment import load_config

    for mixer in ("softmax", "none"):
        with pytest.raises(ConfigError, match=rf"attention_transfer with train.mixer={mixer}: there is nothing to transfer"):
            load_config("", tiny_cfg(**{"train.objective": "attention_transfer", "train.mixer": mixer}))
    t = dict(DEFAULTS["train"])
    assert "transfer_steps" not in effective_train(t)
    assert effective_train({**t, "objective": "attention_transfer", "mixer": "linear"})["transfer_steps"] == 50


def test_a_decode_memory_budget_chooses_which_partitions_keep_softmax(tmp_path):
    import luigi
    from transformers import AutoModelForCausalLM

    from workflows import load_config
    from workflows.library import build_library, library_plan

    over = ("library.variants=[{mixer: softmax}, {mixer: linear_window}] library.budgets=[0.03, 0.6] "
            "library.budget_unit=kv_bytes library.context=1024 train.window=8")
    cfg = load_config("", over, "library_tiny")
    plan = library_plan(cfg)
    # per layer at 1024 tokens, 16-bit: softmax 2 x 2 kv heads x 8 x 1024 x 2 B; linear_window a ring of 8 plus 4 heads' 16x8 state
    soft, conv = (2 * 2 * 8 * 1024 * 2) * 2, (2 * 2 * 8 * 8 + 4 * (2 * 8 * 8 + 2 * 8)) * 2 * 2
    assert [[c["cost"]["kv_bytes"] for c in p] for p in plan["candidates"]] == [[soft, conv], [soft, conv]]
    assert plan["candidates"][0][1]["name"].endswith("linear_window") and plan["teacher_cost"]["kv_bytes"] == 2 * soft
    task = build_library(cfg, str(tmp_path))
    assert luigi.build([task], local_scheduler=True, workers=1, log_level="WARNING")
    rep = json.loads((task.out_dir / "report.json").read_text())
    low, mid = rep["selections"]
    assert low["indices"] == [1, 1]  # 3% of the teacher's cache: nothing keeps softmax
    # 60%: softmax at both partitions does not fit, at one it does; the choice is the feasible pair of least
    # summed in-context CE increase (on a random teacher either answer can win: the rule is what is checked)
    cand = {(c["partition"], c["variant"]): c for c in rep["candidates"]}
    feasible = [ix for ix in ([0, 0], [0, 1], [1, 0], [1, 1]) if sum(cand[(i, v)]["kv_bytes"] for i, v in enumerate(ix)) <= mid["budget"]]
    assert feasible == [[0, 1], [1, 0], [1, 1]]
    assert mid["indices"] == min(feasible, key=lambda ix: sum(cand[(i, v)]["ce_increase"] for i, v in enumerate(ix)))
    model = AutoModelForCausalLM.from_pretrained(mid["model"], trust_remote_code=True)
    assert model.config.layer_mixers == [["softmax", "linear_window"][v] for v in mid["indices"] for _ in range(2)]


def test_library_mixer_variants_fail_at_graph_build_for_a_family_that_cannot_take_them():
    from workflows import load_config
    from workflows.library import library_plan

    with pytest.raises(ConfigError, match=r"library.variants\[1\] \(partition 0\).mixer='linear'.*families that can: llama"):
        library_plan(load_config("", "teacher=tiny-qwen3 library.variants=[{n_layers: 1}, {mixer: linear}]", "library_tiny"))
    with pytest.raises(ConfigError, match=r"library.variants\[0\].mixer must be one of"):
        load_config("", "library.variants=[{mixer: mamba}]", "library_tiny")


def fake_fla(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True, cu_seqlens=None):
    """fla's ``chunk_linear_attn`` contract in plain PyTorch (``[B, T, H, K]`` layout, causal,
    ``normalize=False``: the bare sums), so the CPU can run the dispatch that CUDA takes."""
    assert not normalize and scale == 1.0 and initial_state is None and q.shape[:3] == k.shape[:3] == v.shape[:3]
    t = q.shape[1]
    causal = torch.ones(t, t).tril().bool()
    a = torch.einsum("bthk,bshk->bhts", q, k).masked_fill(~causal, 0)
    return torch.einsum("bhts,bshv->bthv", a, v), None


@pytest.mark.parametrize("mixer", ["linear", "linear_window"])
@pytest.mark.parametrize("length", [5, 3 * WINDOW, 3 * WINDOW + 5])
def test_the_fla_dispatch_computes_what_the_pytorch_form_does(mixer, length, monkeypatch):
    from zgcore.models import hf_converted_llama as hcl
    from zgcore.models import hf_linear_attention as hla

    m = converted([mixer, "softmax", mixer, "window"])
    ids = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(2))

    def run(kernel):
        for mod in m.modules():
            if isinstance(mod, hcl.ZGMixer):
                mod.kernel = kernel
        m.zero_grad()
        out = m(ids).logits
        out.float().pow(2).mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    calls = []
    monkeypatch.setattr(hla, "_FLA", [lambda *a, **kw: calls.append(1) or fake_fla(*a, **kw)])
    want, gwant = run("torch")
    assert not calls
    got, ggot = run("fla")
    assert len(calls) == 2  # one per linear layer: the dispatch ran
    assert (got - want).abs().max() <= 1e-5
    assert gwant.keys() == ggot.keys() and any("feature_q" in n for n in ggot)
    for n in gwant:
        assert torch.allclose(ggot[n], gwant[n], rtol=1e-4, atol=1e-6), n


def test_auto_takes_fla_only_on_cuda_and_fla_fails_in_one_line_without_it(monkeypatch):
    from zgcore.models import hf_converted_llama as hcl
    from zgcore.models import hf_linear_attention as hla

    m = converted(["linear"] * 4)
    ids = torch.randint(0, 256, (1, 12))
    calls = []
    monkeypatch.setattr(hla, "_FLA", [lambda *a, **kw: calls.append(1) or fake_fla(*a, **kw)])
    m(ids)  # "auto" on the CPU: the PyTorch form
    assert not calls
    mix = next(x for x in m.modules() if isinstance(x, hcl.ZGMixer))
    assert mix._use_fla(types.SimpleNamespace(is_cuda=True)) and not mix._use_fla(ids)  # CUDA tensors: fla
    mix.kernel = "torch"
    assert not mix._use_fla(types.SimpleNamespace(is_cuda=True))
    mix.kernel = "auto"
    monkeypatch.setattr(hla, "_FLA", [None])
    for mod in m.modules():
        if isinstance(mod, hcl.ZGMixer):
            mod.kernel = "fla"
    with pytest.raises(ImportError, match="flash-linear-attention"):
        m(ids)


@pytest.mark.parametrize("length,chunk", [(1, 64), (29, 8), (64, 64), (65, 64), (200, 64)])
def test_the_chunked_linear_attention_is_the_dense_sum(length, chunk):
    from zgcore.models.hf_linear_attention import chunked_linear_attn

    g = torch.Generator().manual_seed(length)
    q, k = torch.rand(2, length, 3, 12, generator=g), torch.rand(2, length, 3, 12, generator=g)
    v = torch.randn(2, length, 3, 5, generator=g)
    got, _ = chunked_linear_attn(q, k, v, scale=0.5, normalize=False, chunk=chunk)
    want, _ = fake_fla(q * 0.5, k, v, scale=1.0, normalize=False)
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("mixer", ["window", "linear", "linear_window"])
@pytest.mark.parametrize("length", [5, 3 * WINDOW, 3 * WINDOW + 5, 150])
def test_a_chunked_prefill_computes_what_the_t_by_t_form_does(mixer, length):
    from zgcore.models.hf_converted_llama import ZGMixer

    m = converted([mixer] * 4)
    mix = next(x for x in m.modules() if isinstance(x, ZGMixer))
    g = torch.Generator().manual_seed(length)
    q, k, v = torch.randn(2, 4, length, 8, generator=g), torch.randn(2, 2, length, 8, generator=g), \
        torch.randn(2, 2, length, 8, generator=g)
    with torch.no_grad():
        want, got = mix.parallel(q, k, v), mix.parallel(q, k, v, chunked=True)
    assert (got - want).abs().max() <= 1e-5


def test_generate_refuses_a_padded_batch_as_a_direct_call_does():
    m = converted(["linear_window"] * 4)
    ids = torch.randint(1, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    out = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 14)
    mask[0, :4] = 0  # a left-padded row
    with pytest.raises(ValueError, match="unpadded sequences only"):
        m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
