"""What one task of a ZeroGraph graph costs, predicted from shapes alone: its peak memory split into
weights, optimizer state, activations and buffers; the bytes it writes; its FLOPs (from
:mod:`zgcore.evaluation.flops`, the one count); and its kind of work (``train`` | ``forward`` |
``io``), which the plan (:mod:`zgcore.evaluation.plan`) turns into seconds on a device.

Training tasks' costs are in :mod:`zgcore.evaluation.plan_training`; the table of every task
family and its cost function is :data:`zgcore.evaluation.plan.FAMILIES`. A task is described by its
family, its Luigi parameters as plain JSON and a :class:`Context` (the teacher's
:class:`~zgcore.evaluation.plan_shape.ModelShape`, the corpus's sequences).

The model of memory. Training keeps the weights in float32 (4 bytes a parameter), their gradients
(4), AdamW's two moments (8) and a copy of the initial weights (4, a buffer). Activations kept for
backward per token and decoder layer: ``ACT_D x d + ACT_I x I`` floats (float32 on a CPU; bf16
autocast on CUDA keeps about :data:`AUTOCAST_ACT` of that); a forward without gradients holds one
layer's working set, ``FWD_D x d + FWD_I x I`` floats per token, plus the captured boundaries. Every
process starts from :data:`BASE_HOST` resident bytes (Python, torch, transformers, Luigi, h5py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Mapping

from zgcore.evaluation import flops
from zgcore.evaluation.plan_shape import ModelShape, student_shape

BASE_HOST = 400 * 2**20  # RSS of a task process before its work (imports, Luigi worker): measured, docs/scale.md
ACT_D, ACT_I = 18, 5  # floats kept for backward per token per layer (per unit of width / MLP width): docs/scale.md
FWD_D, FWD_I = 6, 3  # floats live in one layer's forward without gradients, per token
AUTOCAST_ACT = 0.55  # share of the float32 activation bytes kept under CUDA bf16 autocast
H5_FILE_OVERHEAD = 2048  # bytes of an HDF5 file of contiguous datasets outside their data (superblock, headers)
H5_CHUNKED_OVERHEAD = 4352  # more for a chunked, checksummed dataset (the sums of squares: B-tree, filter pipeline)
SMALL_FILE = 1536  # a JSON record (task.json and its checksum, a metrics file)
WRITE_BPS, READ_BPS = 1.0e9, 2.0e9  # disk bytes per second written and read (a local NVMe or page cache)
HASH_BPS = 0.5e9  # bytes per second SHA-256 fingerprints a teacher's weight files (one core)
TASK_START_S = 2.0  # seconds a task spends loading before its work
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

# bytes a codec stores per element of a boundary, by boundary.codec: the one place a codec plugs in
# ("none": the storage dtype's itemsize). A codec registers ``name -> f(dtype) -> bytes per element``.
CODECS: dict[str, Callable[[str], float]] = {"none": lambda dtype: float(DTYPE_BYTES[dtype])}


def element_bytes(boundary: Mapping[str, Any]) -> float:
    """Bytes the boundary store keeps per stored element under ``boundary`` (its ``dtype`` and its
    ``codec``, "none" when the setting is absent).

    Raises:
        KeyError: a codec without an entry in :data:`CODECS`."""
    codec = str(boundary.get("codec", "none") or "none")
    if codec not in CODECS:
        raise KeyError(
            f"boundary.codec {codec!r} has no bytes-per-element entry in zgcore.evaluation.plan_costs.CODECS"
        )
    return CODECS[codec](str(boundary.get("dtype", "float32")))


@dataclass
class Context:
    """What every cost function reads besides a task's parameters. ``teacher``: its shape;
    ``n_train``, ``n_val``: sequences of the tokenised corpus; ``accelerator``: the graph's tasks
    run on an accelerator (``device = cuda``), whose memory then holds the model."""

    teacher: ModelShape
    n_train: int
    n_val: int
    accelerator: bool = False
    held_out_rows: int | None = None


@dataclass
class Cost:
    """One task's prediction. ``memory``: bytes by part (``weights``, ``optimizer``, ``activations``,
    ``buffers``), where the model lives (the device on an accelerator, else the host); ``host_extra``:
    bytes the host holds besides :data:`BASE_HOST` on an accelerator; ``scratch``: bytes on disk
    only while it runs (checkpoints); ``read``: bytes it reads."""

    kind: str
    flops: int = 0
    bytes_written: int = 0
    read: int = 0
    scratch: int = 0
    memory: dict[str, int] = field(default_factory=dict)
    host_extra: int = 0

    def split(self, accelerator: bool) -> tuple[dict[str, int], dict[str, int]]:
        """``(host, device)`` bytes by part; on a CPU the device's are zeros."""
        parts = {k: int(self.memory.get(k, 0)) for k in ("weights", "optimizer", "activations", "buffers")}
        if not accelerator or self.kind == "io":
            return {**parts, "process": BASE_HOST}, dict.fromkeys(parts, 0)
        return {"weights": 0, "optimizer": 0, "activations": 0, "buffers": self.host_extra, "process": BASE_HOST}, parts


def _act_scale(ctx: Context) -> float:
    return AUTOCAST_ACT if ctx.accelerator else 1.0


def _rows(ctx: Context, corpus: Mapping[str, Any]) -> int:
    return ctx.n_train + ctx.n_val


def prepare_teacher(p: Mapping[str, Any], ctx: Context) -> Cost:
    """PrepareTeacher: a GGUF de-quantised into a float32 folder, a tiny teacher built, or a local
    folder recorded (its weight files read once for their fingerprint, at :data:`HASH_BPS`)."""
    spec = str(p["teacher"])
    built = spec == "smollm2-135m" or spec.startswith("tiny-")
    weights = 4 * ctx.teacher.total() if built else 0
    cfg = ctx.teacher.config
    on_disk = ctx.teacher.total() * DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"), 4)
    c = Cost("io", bytes_written=weights + SMALL_FILE, memory={"weights": 2 * weights})
    c.read = (
        0 if built else int(on_disk * READ_BPS / HASH_BPS)
    )  # hashing is the slower reader: seconds_on divides by READ_BPS
    return c


def prepare_corpus(p: Mapping[str, Any], ctx: Context) -> Cost:
    """PrepareCorpus: int32 token ids and each row's document id (int64)."""
    rows, T = _rows(ctx, p["corpus"]), int(p["corpus"]["seq_len"])
    buf = int(p["corpus"].get("buffer_tokens", 1 << 20)) * 8
    return Cost("io", bytes_written=rows * (4 * T + 8) + 2 * H5_FILE_OVERHEAD + SMALL_FILE, memory={"buffers": buf})


def prepare_heldout(p: Mapping[str, Any], ctx: Context) -> Cost:
    """PrepareHeldOut: an out-of-domain corpus tokenised like PrepareCorpus."""
    T = int(p["seq_len"])
    rows = _held_out_rows(p["extra"], T, ctx)
    return Cost("io", bytes_written=rows * (4 * T + 8) + 128 + SMALL_FILE, memory={"buffers": 1 << 23})


def _held_out_rows(extra: Mapping[str, Any], seq_len: int, ctx: Context) -> int:
    cap = int(extra.get("max_tokens") or 0)
    return cap // seq_len if cap else ctx.held_out_rows or ctx.n_val


def shard_file_bytes(m: int, seq_len: int, width: float, boundary: Mapping[str, Any], stats_rows: int) -> int:
    """Bytes of one boundary's HDF5 file in a shard of ``m`` sequences: the stored elements at
    :func:`element_bytes`, one uint64 xxh3 per sequence, ``stats_rows x 2 x width`` float64 sums
    of squares and the file's own overhead."""
    return (
        int(math.ceil(m * seq_len * width * element_bytes(boundary)))
        + 8 * m
        + 16 * stats_rows * int(width)
        + H5_FILE_OVERHEAD
        + (H5_CHUNKED_OVERHEAD if stats_rows else 0)
    )


def _boundaries(boundary: Mapping[str, Any], n_layers: int) -> list[int]:
    from zgcore.models.shapes import resolve_boundaries

    return resolve_boundaries(boundary, n_layers)


def boundary_shard(p: Mapping[str, Any], ctx: Context) -> Cost:
    """BoundaryShard: the teacher up to the last boundary over ``hi - lo`` sequences, every boundary stored."""
    from zgcore.data.boundary_store.common import STATS_SEQUENCES

    t, b, T = ctx.teacher, p["boundary"], int(p["corpus"]["seq_len"])
    bs = _boundaries(b, t.n_layers)
    m, lo = int(p["hi"]) - int(p["lo"]), int(p["lo"])
    stats = max(0, min(m, STATS_SEQUENCES - lo)) if p["split"] == "train" else 0
    written = len(bs) * shard_file_bytes(m, T, t.width, b, stats) + 2 * SMALL_FILE
    wbytes = DTYPE_BYTES[str(b.get("teacher_dtype", "float32"))]
    # the embedding's resident rows: those the corpus's tokens look up (the weights are memory-mapped; no LM head runs)
    rows = min(t.vocab, (ctx.n_train + ctx.n_val) * T)
    weights = wbytes * (sum(t.layers[: max(bs)]) + (t.embed if t.model_type == "gpt2" else rows * t.width))
    batch = int(b["batch_size"]) * T
    act = batch * (FWD_D * t.width + FWD_I * t.intermediate) * 4 * _act_scale(ctx)
    captured = batch * t.width * 4 * len(bs) * 2  # float32 boundaries and their stored copies
    return Cost(
        "forward",
        flops=flops.cache_build_flops(t.flops_par(), m, T, max(bs)),
        bytes_written=written,
        read=weights,
        memory={"weights": weights, "activations": int(act), "buffers": int(captured) + m * T * 4},
        host_extra=int(captured) + m * T * 4,
    )


def logit_shard(p: Mapping[str, Any], ctx: Context) -> Cost:
    """TeacherLogits: the whole teacher and its head over a range; top-k records of ``2k + 1`` float32 per token."""
    t, T, k = ctx.teacher, int(p["corpus"]["seq_len"]), int(p["logits"]["top_k"])
    m = int(p["hi"]) - int(p["lo"])
    weights = 4 * t.total()
    batch = int(p["boundary"]["batch_size"]) * T
    logits = batch * t.vocab * 4 * 3
    return Cost(
        "forward",
        flops=flops.forward_flops(t.flops_par(), m * T, T),
        bytes_written=m * T * 4 * (2 * k + 1) + 8 * m + H5_FILE_OVERHEAD + 2 * SMALL_FILE,
        read=weights,
        memory={"weights": weights, "activations": int(batch * FWD_D * t.width * 4) + logits, "buffers": m * T * 4},
    )


def join(p: Mapping[str, Any], ctx: Context) -> Cost:
    """TeacherBoundary / TeacherLogitStore: a manifest and per-boundary RMS statistics."""
    bs = _boundaries(p["boundary"], ctx.teacher.n_layers)
    shards = math.ceil(ctx.n_train / int(p["boundary"]["shard_sequences"])) + math.ceil(
        ctx.n_val / int(p["boundary"]["shard_sequences"])
    )
    return Cost(
        "io",
        bytes_written=len(bs) * (8 * ctx.teacher.width + 128) + 600 * shards * len(bs) + SMALL_FILE,
        # the statistics rows it reads: 64 sequences' float64 sums of squares ([2, width]) per boundary
        memory={"buffers": len(bs) * 64 * 16 * ctx.teacher.width},
    )


def _student_layers(p: Mapping[str, Any], ctx: Context) -> int:
    from zgcore.models.shapes import n_kept

    bs = _boundaries(p["boundary"], ctx.teacher.n_layers)
    return sum(n_kept(bs[i], bs[i + 1], blk) for i, blk in enumerate(p["blocks"]))


def assemble(p: Mapping[str, Any], ctx: Context) -> Cost:
    """Assemble / AssembleExact: the student's Hugging Face folder in float32 (and the tokenizer)."""
    if "blocks" in p and "boundary" in p:
        stu = student_shape(ctx.teacher, _student_layers(p, ctx), p["blocks"][0].get("intermediate_size"))
    else:
        stu = ctx.teacher
    w = 4 * stu.total()
    return Cost("io", bytes_written=w + 2 * 2**20, read=w, memory={"weights": 2 * w})


def _score(shape: ModelShape, p: Mapping[str, Any], ctx: Context, rows: int, passes: int = 1) -> Cost:
    T = int(p["corpus"]["seq_len"])
    ev = p.get("eval") or {}
    ctx_seq = int(ev.get("context_sequences", 0)) if "eval" in p else 0
    work = passes * flops.scoring_flops(shape.flops_par(), rows, T, ctx_seq, int(ev.get("context_window", 0)))
    w = 4 * shape.total()
    batch = int(ev.get("batch_size", 8)) * T
    act = batch * (FWD_D * shape.width + FWD_I * shape.intermediate) * 4 * _act_scale(ctx) + batch * shape.vocab * 4 * 3
    return Cost(
        "forward",
        flops=work,
        bytes_written=rows * 40 + SMALL_FILE * 3,
        read=w,
        memory={"weights": w, "activations": int(act), "buffers": rows * T * 4},
        host_extra=rows * T * 4,
    )


def _eval_rows(p: Mapping[str, Any], ctx: Context) -> int:
    cap = int((p.get("eval") or {}).get("max_sequences") or 0)
    held = p.get("held_out")
    n = _held_out_rows(held, int(p["corpus"]["seq_len"]), ctx) if held else ctx.n_val
    return min(n, cap) if cap else n


def score_teacher(p: Mapping[str, Any], ctx: Context) -> Cost:
    """ScoreTeacher / LayerImportance: the teacher's forward over the scored rows."""
    return _score(ctx.teacher, p, ctx, _eval_rows(p, ctx))


def score_student(p: Mapping[str, Any], ctx: Context) -> Cost:
    """ScoreUntrained / ScoreAssembled / ScoreStudent / EvaluateStudent / ScoreCandidate: a student's forward."""
    n = _student_layers(p, ctx) if "blocks" in p and "boundary" in p else ctx.teacher.n_layers
    return _score(student_shape(ctx.teacher, n), p, ctx, _eval_rows(p, ctx))


def score_block(p: Mapping[str, Any], ctx: Context) -> Cost:
    """ScoreBlock: a trained block's validation loss over the stored validation boundaries."""
    from zgcore.models.shapes import n_kept

    t, T = ctx.teacher, int(p["corpus"]["seq_len"])
    bs = _boundaries(p["boundary"], t.n_layers)
    s, e = bs[int(p["block"])], bs[int(p["block"]) + 1]
    n = n_kept(s, e, p["train"])
    stu = student_shape(t, n)
    return Cost(
        "forward",
        flops=ctx.n_val * T * flops.layers_forward(list(stu.layers), T, t.width),
        bytes_written=SMALL_FILE,
        memory={"weights": 4 * sum(stu.layers)},
    )


def boundary_shift(p: Mapping[str, Any], ctx: Context) -> Cost:
    """BoundaryShift: on ``eval.context_sequences`` test rows (4 when 0), the teacher to its last
    boundary, and each block on teacher inputs, on the chain's and on three noise levels (5 passes)."""
    t, T = ctx.teacher, int(p["corpus"]["seq_len"])
    rows = min(int((p.get("eval") or {}).get("context_sequences") or 4), ctx.n_val)
    bs = _boundaries(p["boundary"], t.n_layers)
    stu = student_shape(t, _student_layers(p, ctx))
    work = (
        rows
        * T
        * (
            flops.layers_forward(t.layers[: bs[-1]], T, t.width)
            + 5 * flops.layers_forward(list(stu.layers), T, t.width)
        )
    )
    w = 4 * (t.total() + stu.total())
    act = rows * T * (FWD_D * t.width + FWD_I * t.intermediate) * 4 * _act_scale(ctx) + rows * T * t.width * 4 * len(bs)
    return Cost(
        "forward",
        flops=int(work),
        bytes_written=SMALL_FILE * 4,
        read=w,
        memory={"weights": w, "activations": int(act), "buffers": rows * T * 4},
    )


def report(p: Mapping[str, Any], ctx: Context) -> Cost:
    """A report or a choice over other tasks' JSON (Evaluate, the studies' reports, SelectBudget)."""
    return Cost("io", bytes_written=64 * 1024, memory={"buffers": 8 * 2**20})
