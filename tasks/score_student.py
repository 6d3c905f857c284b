"""The student's side of scoring: :class:`ScoreAssembled` (the assembled or healed student on
one held-out set, keyed by its assembly) and :class:`BoundaryShift` (each trained block off the
teacher's trajectory and the student chain's drift, keyed by the trained blocks). See
:mod:`tasks.score` for the teacher's and the untrained student's."""
from __future__ import annotations

import json
import time

import luigi

from zgcore.atomic import write_json
from zgcore.data import corpus
from zgcore.evaluation import flops, metrics
from zgcore.training import mfu

from .assemble import Assemble, _StudentTask
from .base import HIDDEN
from .blocks import load_blocks
from .heal import Heal
from .score import METRICS, _Score
from .teacher import PrepareCorpus

SHIFT = "shift.json"
SAMPLE_TOKENS = 24  # greedy tokens the student generates after "The" (the report's sample)


def student_model_task(task, heal) -> Assemble | Heal:
    """The student ``task`` (a ``_StudentTask``) evaluates: the healed one when ``heal.steps`` > 0,
    else the assembled one."""
    kw = task.shared_params(boundary=task.boundary, blocks=task.blocks, study=task.study_name(), device=task.device)
    return Heal(heal=heal, **kw) if int(heal.get("steps", 0)) else Assemble(**kw)


class ScoreAssembled(_Score, _StudentTask):
    """The assembled student's (or, with ``heal.steps`` > 0, the healed student's) scores on one
    held-out set; on the test rows of the validation split also the greedy sample the report
    shows (``sample``: :data:`SAMPLE_TOKENS` tokens after "The"). Keyed by the student's assembly."""

    key = "student"
    heal = luigi.DictParameter(default={"steps": 0}, visibility=HIDDEN,
                               description="heal section; steps > 0 scores the healed student (tasks.heal.Heal)")

    def model_requires(self):
        return {"model": student_model_task(self, self.heal)}

    def label(self):
        return ("healed-" if int(self.heal.get("steps", 0)) else "") + super().label()

    def load_model(self):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from zgcore.models.families import ADAPTERS
        from zgcore.models.teacher_stream import StreamedTeacher, activation_bytes, plan

        folder = self.model_requires()["model"].out_dir / "model"
        cfg = AutoConfig.from_pretrained(folder, trust_remote_code=True)
        if cfg.model_type in ADAPTERS:  # a student of the teacher's own family streams as the teacher does
            rec = {"path": str(folder), "gguf_file": None}
            n = int(self.eval.get("max_sequences") or 0) or 64
            act = activation_bytes(n, int(self.corpus["seq_len"]), int(cfg.hidden_size), "float32", 1)
            if plan(rec, int(cfg.num_hidden_layers), "float32", self.device, True, act):
                return StreamedTeacher(rec, head=True, device=self.device)
        # trust_remote_code: a converted student's folder carries its modelling code (zgcore.models.hf_converted_llama)
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=True).to(self.device)

    def extra_outputs(self, model, tokens):
        if not self.in_domain_test():
            return {}
        from .teacher import teacher_tokenizer

        tok = teacher_tokenizer(self.teacher_task())
        ids = tok("The", return_tensors="pt").input_ids.to(self.device)
        if hasattr(model, "precompute"):  # streamed: greedy, a whole forward per token (no cache)
            out = _greedy(model, ids, SAMPLE_TOKENS)[0]
        else:
            out = model.generate(ids, max_new_tokens=SAMPLE_TOKENS, do_sample=False)[0]
        return {"sample": tok.decode(out, skip_special_tokens=True),
                "model_dir": str(self.model_requires()["model"].out_dir / "model")}


class BoundaryShift(_StudentTask):
    """Each trained block's output error on the teacher's inputs, on the student chain's and on
    noisy ones, the chain's drift from the teacher at every boundary, and the teacher's massive
    activations (:func:`zgcore.evaluation.metrics.boundary_shift`) on the first
    ``eval.context_sequences`` (4 when 0) test rows; ``shift.json``. Keyed by the trained blocks."""

    eval = luigi.DictParameter(visibility=HIDDEN, description="the eval settings (rows and context_sequences hashed)")

    def requires(self):
        return {"teacher": self.teacher_task(), "blocks": self.block_tasks(),
                "corpus": self.shared(PrepareCorpus)}

    def own_config(self):
        return {"eval": {k: int(self.eval[k]) for k in ("max_sequences", "subset_seed", "context_sequences")}}

    def label(self):
        return "shift"

    def store_task(self):
        """The teacher cache whose ``val`` shards hold the teacher's boundaries this task needs, bitwise
        as its forward gives them (float32 teacher and storage, no boundary codec: a coded store holds
        approximations), when the experiment builds it (a block with cached targets); else None: the teacher
        runs here."""
        b = self.boundary
        if b["dtype"] != "float32" or b["teacher_dtype"] != "float32" or b.get("codec", "none") != "none" or \
                not any(t["targets"] == "cached" for t in self.blocks):
            return None
        from .cache import TeacherBoundary

        return TeacherBoundary(teacher=self.teacher, corpus=self.corpus, boundary=self.boundary, outputs=self.outputs,
                               device=self.device)

    def dynamic_upstream(self):
        store = self.store_task()
        return [store] if store is not None else []

    def run(self):
        from zgcore.data import boundary_store
        from zgcore.device import resolve
        from zgcore.models.teacher_stream import teacher_for
        from zgcore.models.teacher_weights import layer_source

        from .teacher import teacher_record

        req, store = self.requires(), self.store_task()
        if store is not None:
            yield store  # complete already: the cached blocks trained on it
        rec = teacher_record(self.teacher_task())
        val = corpus.read_tokens(req["corpus"].out_dir / "tokens.h5", "val")
        idx = metrics.eval_subset(len(val), int(self.eval["max_sequences"]), int(self.eval["subset_seed"]))
        blocks = [json.loads(t.checked("metrics.json").read_text()) for t in req["blocks"]]
        bounds = [b["start"] for b in blocks] + [blocks[-1]["end"]]
        idx = idx[: min(int(self.eval["context_sequences"]) or 4, len(idx))]
        rows = val[idx]
        source = layer_source(rec, self.device)
        trained = [b.to(resolve(self.device)) for b in load_blocks(source, req["blocks"], "block")]
        t0 = time.perf_counter()
        if store is not None:  # the teacher's validation boundaries as stored: no teacher forward
            with boundary_store.BoundaryReader(store.out_dir) as r:
                bd = {b: r.read("val", b, idx).float() for b in bounds}
            shift = metrics.boundary_shift(None, trained, bounds, rows, teacher_boundaries=bd)
        else:
            teacher = teacher_for(rec, bounds[-1], "float32", self.device)
            shift = metrics.boundary_shift(teacher, trained, bounds, rows)
        seconds = time.perf_counter() - t0
        # the teacher to the last boundary once; every block on the teacher's, the chain's and each noisy input
        par, T = _layer_parameters(source), rows.shape[1]
        student = [sum(p.numel() for p in layer.parameters()) for b in trained for layer in b.layers]
        work = int(rows.size) * (flops.layers_forward(par["layers"][: bounds[-1]], T, par["width"])
                                 + (2 + len(shift["scales"])) * flops.layers_forward(student, T, par["width"]))
        with self.building() as tmp:
            write_json(tmp / SHIFT, shift)
            write_json(tmp / METRICS, {"seconds": seconds, **mfu.utilisation(work, seconds, self.device)})
        self.log("drift " + ", ".join(f"b{d['boundary']}: {d['relative_error']:.4f}" for d in shift["drift"]))


def _layer_parameters(source) -> dict:
    """``{"layers": [P per decoder layer], "width": d}`` of the teacher behind a layer source (safetensors
    headers, or the loaded teacher)."""
    if hasattr(source, "layer_numel"):
        return {"layers": [source.layer_numel(i) for i in range(int(source.config.num_hidden_layers))],
                "width": int(source.config.get_text_config().hidden_size)}
    return flops.decoder_parameters(source)


def _greedy(model, ids, new: int):
    """Greedy decoding of ``new`` tokens after ``ids`` ``[1, T]`` by whole forwards, stopping at the
    config's end-of-sequence id: the sample of a streamed student."""
    import torch

    eos = getattr(model.config, "eos_token_id", None)
    for _ in range(new):
        nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt.to(ids.device)], 1)
        if eos is not None and int(nxt) in (eos if isinstance(eos, list) else [eos]):
            break
    return ids
