"""The input pipeline: the store's per-run read path, the prefetching worker (order,
bound, errors), prefetch on/off identity of a trained block, a damaged shard met by the prefetch
worker, and TensorBoard event files written while a run is in progress, one run per task."""
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from tests.conftest import tiny_cfg
from tests.test_shards import FAILURES, tasks_of  # one failure recorder (a Luigi event handler) for both files
from workflows import RunExperiment
from zgcore.data.boundary_store import TORCH_DTYPES, BoundaryReader, BoundaryStoreError, build_store, from_storage
from zgcore.data.feed import prefetch
from zgcore.models.teacher import load, materialise

REPO = Path(__file__).resolve().parents[1]
Batch = __import__("collections").namedtuple("Batch", "step x")  # an item type a source may yield (picklable: module level)


# -- the prefetching worker

@pytest.mark.parametrize("mode", ["thread", "process"])
def test_prefetch_keeps_the_order_and_at_most_ahead_items_in_flight(mode):
    import multiprocessing
    import os
    import threading

    ctx = multiprocessing.get_context("fork")
    produced, received, beyond, pid = ctx.Value("i", 0), ctx.Value("i", 0), ctx.Value("i", -99), ctx.Value("i", 0)
    where = {}

    def source(worker, workers):
        assert (worker, workers) == (0, 1)
        pid.value = os.getpid()
        where["thread"] = threading.get_ident()
        for i in range(40):
            beyond.value = max(beyond.value, i - received.value)  # how far past the items received this one is
            produced.value += 1
            yield i, torch.full((3,), float(i))

    rng = torch.get_rng_state()
    for ahead in (1, 3):
        produced.value, received.value, beyond.value = 0, 0, -99
        got, held = [], []
        for i, x in prefetch(source, ahead, mode=mode):
            received.value += 1
            got.append((i, x.tolist()))
            time.sleep(0.01)  # a consumer slower than the source: the worker runs as far ahead as allowed
            held.append(produced.value - received.value)  # produced, not yet handed out, while the step works
        assert got == [(i, [float(i)] * 3) for i in range(40)]
        if mode == "process":
            assert pid.value != os.getpid()  # produced in a worker process
        else:
            assert pid.value == os.getpid() and where["thread"] != threading.get_ident()  # in a worker thread
        assert beyond.value <= ahead and max(held) == ahead and all(h <= ahead for h in held)
    assert not multiprocessing.active_children()  # the worker is gone
    assert not [t for t in threading.enumerate() if t.name.startswith("zerograph-prefetch")]
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG (a checkpoint records it) is untouched
    assert [i for i, _ in prefetch(source, 0)] == list(range(40)) and pid.value == os.getpid()


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_several_workers_take_turns_and_keep_the_order(mode):
    def source(worker, workers):
        for i in range(worker, 30, workers):
            if i == 23:
                raise BoundaryStoreError("boundary shard file /x/b4.h5: 1 non-finite value(s)")
            yield i, torch.full((2,), float(i))

    got = []
    with pytest.raises(BoundaryStoreError, match="/x/b4.h5"):
        for i, x in prefetch(source, 2, workers=3, mode=mode):
            got.append(i)
            assert x.tolist() == [float(i)] * 2
    assert got == list(range(23))  # in order across the three workers, up to the failing item


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_prefetch_raises_the_sources_error_at_its_item_with_its_message_and_stops_the_worker(mode):
    import multiprocessing
    import threading

    def source(worker, workers):
        for i in range(10):
            if i == 3:
                raise BoundaryStoreError("boundary shard file /x/b2.h5: checksum failure while reading")
            yield i

    got = []
    with pytest.raises(BoundaryStoreError) as e:
        for x in prefetch(source, 4, mode=mode):
            got.append(x)
    assert got == [0, 1, 2] and str(e.value) == "boundary shard file /x/b2.h5: checksum failure while reading"

    def endless(worker, workers):
        i = 0
        while True:
            yield i
            i += 1

    it = prefetch(endless, 2, mode=mode)
    assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]
    it.close()  # the consumer stops early: the worker stops at once
    assert not multiprocessing.active_children()
    assert not [t for t in threading.enumerate() if t.name.startswith("zerograph-prefetch")]
    with pytest.raises(ValueError, match="thread, process"):
        next(prefetch(endless, 2, mode="fibre"))


def test_a_thread_worker_whose_source_fails_to_start_or_raises_a_base_exception_does_not_hang_the_consumer():
    import threading

    def broken(worker, workers):
        raise TypeError("bad source arguments")

    class Halt(BaseException):
        pass

    def halting(worker, workers):
        yield 0
        raise Halt("stop")

    got = {}

    def consume():
        for name, src, exc in (("broken", broken, TypeError), ("halting", halting, Halt)):
            try:
                list(prefetch(src, 2, workers=2, mode="thread"))
            except exc as e:
                got[name] = str(e)

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    t.join(10)
    assert got == {"broken": "bad source arguments", "halting": "stop"}
    assert not [t for t in threading.enumerate() if t.name.startswith("zerograph-prefetch")]


# -- the read path

@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    d = tmp_path_factory.mktemp("feed")
    model, _ = load(materialise("tiny-llama", outputs=d))
    rng = np.random.default_rng(0)
    tokens = {"train": rng.integers(0, 256, (11, 16)).astype(np.int32), "val": rng.integers(0, 256, (3, 16)).astype(np.int32)}
    out = {}
    for dtype in ("float32", "bfloat16", "float16"):
        build_store(d / dtype, model, tokens, [0, 2], dtype, 2, {}, shard_sequences=4, log=lambda m: None)
        out[dtype] = d / dtype
    return out


def test_closing_a_prefetch_returns_within_a_bounded_time_while_a_worker_is_in_a_long_read():
    """A worker thread stuck in a 60 s read does not hold up the consumer that stops (Ctrl-C, an
    error): closing returns within CLOSE_WAIT_S (2 s), not when the read ends."""
    import threading

    from zgcore.data.feed import CLOSE_WAIT_S

    release = threading.Event()

    def slow(worker, workers):
        yield 0
        release.wait(60)  # a long read on a slow file system
        yield 1

    it = prefetch(slow, 2, workers=1, mode="thread")
    assert next(it) == 0
    time.sleep(0.2)  # the worker is now inside the long read
    t0 = time.monotonic()
    it.close()
    took = time.monotonic() - t0
    release.set()
    assert took < CLOSE_WAIT_S + 1.0, took


def test_a_worker_that_ends_without_an_item_is_one_line_saying_what_to_do(monkeypatch):
    import threading

    from zgcore.data.feed import PrefetchError

    real = threading.Thread.start

    def start_nothing(self):  # a worker thread that ends without running its target
        if self.name.startswith("zerograph-prefetch-"):
            self._target = lambda *a: None
        return real(self)
    monkeypatch.setattr(threading.Thread, "start", start_nothing)
    with pytest.raises(PrefetchError) as e:
        list(prefetch(lambda w, n: iter([1, 2]), 2, workers=1, mode="thread"))
    assert len(str(e.value).splitlines()) == 1 and "train.prefetch=0" in str(e.value)


def test_worker_processes_reuse_their_buffers_but_never_one_the_consumer_still_holds():
    """A worker process hands items over in reused shared-memory buffers. A consumer that drops each
    item gets the same few buffers back again and again (no fresh mapping per batch); one that keeps
    every item (a list, a view, a tensor saved for backward) still sees each item's own values at
    the end: a buffer is reused only once nothing in the consumer refers to it."""
    from zgcore.data.process_workers import SLOT_SLACK

    def source(worker, workers):
        for i in range(worker, 40, workers):
            yield i, torch.full((4, 8), float(i)), torch.full((2,), -float(i))

    ptrs = set()
    for i, x, y in prefetch(source, 2, workers=2, mode="process"):
        assert x.eq(i).all() and y.eq(-i).all()
        ptrs.add(x.data_ptr())
    assert len(ptrs) <= 2 * (2 + SLOT_SLACK)  # the buffers went round: 40 items in at most 10 buffers for x

    kept = list(prefetch(source, 2, workers=2, mode="process"))  # the consumer keeps them all
    assert [i for i, *_ in kept] == list(range(40))
    assert all(x.eq(i).all() and y.eq(-i).all() for i, x, y in kept)
    views, saved, w = [], [], torch.ones(8, 1, requires_grad=True)
    for i, x, _ in prefetch(source, 1, workers=1, mode="process"):
        if i % 2:
            views.append((i, x[1:]))  # a view keeps the buffer's storage
        else:
            saved.append((i, (x @ w).sum()))  # autograd keeps x for the backward pass
    assert all(v.eq(i).all() for i, v in views)
    for i, loss in saved:
        loss.backward()
        assert torch.equal(w.grad, torch.full((8, 1), 4.0 * i)) and w.grad.zero_() is not None


def test_worker_processes_survive_sources_that_keep_reuse_or_cannot_send_what_they_yield():
    """A source that yields a batch again later (a history), or one tensor twice in an item, still
    hands each item its own values (a buffer is lent again only once the worker's side lets go of it
    too); a named tuple stays one; an item or an error that cannot be pickled is raised in the
    consumer, naming it, instead of being dropped by a queue while the consumer waits forever."""
    import collections
    import threading

    from zgcore.data.boundary_store import memory

    def history(worker, workers):  # item i: (i, batch i, batch i-3, batch i again)
        pool, hist = {}, collections.deque(maxlen=4)
        for i in range(30):
            x = memory.batch_tensor(pool, (4, 4), torch.float32, False)
            x.fill_(i)
            hist.append(x)
            yield i, x, hist[0], x

    for i, x, old, again in prefetch(history, 2, mode="process"):
        time.sleep(0.002)  # the step: the worker runs ahead meanwhile
        assert x.eq(i).all() and old.eq(max(i - 3, 0)).all() and again.eq(i).all()

    assert {type(b).__name__ for b in prefetch(lambda w, n: (Batch(i, torch.zeros(2)) for i in range(5)), 2,
                                               mode="process")} == {"Batch"}

    class TwoArgs(Exception):
        def __init__(self, a, b):  # its args do not rebuild it
            super().__init__(f"{a}: {b}")

    def unsendable(worker, workers):
        yield 0, torch.zeros(2), None
        yield 1, torch.zeros(2), (lambda: 1)  # a lambda does not pickle

    def raises(worker, workers):
        yield 0
        raise TwoArgs("boundary shard file /x/b2.h5", "checksum failure")

    for source, match in ((unsendable, "pickle"), (raises, "TwoArgs: boundary shard file /x/b2.h5: checksum failure")):
        errors: list[str] = []

        def consume(source=source, errors=errors):
            try:
                for _ in prefetch(source, 1, mode="process"):
                    pass
            except Exception as e:  # noqa: BLE001
                errors.append(str(e))

        t = threading.Thread(target=consume, daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive() and len(errors) == 1 and match in errors[0], errors


def test_worker_processes_that_die_block_on_a_large_item_or_hand_odd_values_neither_lose_items_nor_hang():
    """A worker process killed after handing over items (a segfault, the OOM killer): the consumer
    gets every item it handed over, then the one-line PrefetchError, never a raw pipe error. A
    worker blocked sending an item larger than the pipe holds is stopped at once when the consumer
    closes (its source closed, no 2 s wait nor SIGTERM). A consumer keeping only a batch's storage
    keeps its values; an error carrying a tensor arrives whole."""
    import os

    from zgcore.data.feed import PrefetchError

    def dies(worker, workers):
        yield from (torch.full((2,), float(i)) for i in range(3))
        time.sleep(0.2)  # the consumer's credits arrive, unread
        os._exit(1)

    got = []
    with pytest.raises(PrefetchError, match="train.prefetch=0"):
        for x in prefetch(dies, 2, workers=1, mode="process"):
            got.append(float(x[0]))
            time.sleep(0.1)
    assert got == [0.0, 1.0, 2.0]

    import multiprocessing

    closed = multiprocessing.get_context("fork").Value("i", 0)

    def large(worker, workers):
        try:
            for i in range(100):
                yield i, bytes(300_000)  # by value, more than a pipe's buffer for each item
        finally:
            with closed.get_lock():
                closed.value += 1  # the source's own cleanup runs

    it = prefetch(large, 2, workers=2, mode="process")
    assert next(it)[0] == 0
    time.sleep(0.5)  # both workers are blocked in a send
    t0 = time.perf_counter()
    it.close()
    assert time.perf_counter() - t0 < 1.0 and closed.value == 2

    def own_pipe_breaks(worker, workers):  # the source's own pipe error is the source's: raised in the consumer
        yield 0
        raise BrokenPipeError("the source's socket")

    with pytest.raises(BrokenPipeError, match="the source's socket"):
        list(prefetch(own_pipe_breaks, 2, mode="process"))

    storages = [(i, x.untyped_storage()) for i, x in
                prefetch(lambda w, n: ((i, torch.full((16,), float(i))) for i in range(30)), 2, mode="process")]
    assert all(torch.tensor([], dtype=torch.float32).set_(s).eq(i).all() for i, s in storages)

    def fails(worker, workers):
        yield 0
        raise ValueError("bad batch", torch.arange(3))

    with pytest.raises(ValueError, match="bad batch") as e:
        list(prefetch(fails, 2, mode="process"))
    assert torch.equal(e.value.args[1], torch.arange(3))


def test_with_pin_memory_a_thread_copies_each_process_batch_out_of_its_buffer(monkeypatch):
    """On CUDA (``pin_memory``) the batches of worker processes are copied into page-locked memory
    by one thread of the training process, not by the training thread, and the shared buffer goes
    back to its worker after the copy. Here the page-locked copy is stood in for by a clone (no
    CUDA on this machine): order, values and the copying thread are checked."""
    import threading

    import zgcore.data.feed as feed

    copied_on = set()

    def fake_pin(item):
        copied_on.add(threading.current_thread().name)
        return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in item)

    monkeypatch.setattr(feed, "_pinned", fake_pin)

    def source(worker, workers):
        for i in range(worker, 30, workers):
            yield i, torch.full((8, 4), float(i))

    kept = list(prefetch(source, 2, pin_memory=True, workers=2, mode="process"))
    assert [i for i, _ in kept] == list(range(30)) and all(x.eq(i).all() for i, x in kept)
    assert copied_on == {"zerograph-prefetch-0"}  # the pinning thread, never the consumer
    assert len({x.data_ptr() for _, x in kept}) == 30  # the consumer holds copies, not the buffers


def test_a_worker_process_whose_training_process_is_killed_exits_on_its_own():
    """kill -9 of a training process leaves nothing behind: its prefetch worker processes notice
    that their parent is gone and exit (within a second or two), releasing the files they hold."""
    import os
    import signal
    import subprocess
    import sys

    code = ("import sys, time, torch, multiprocessing as mp\n"
            "from zgcore.data.feed import prefetch\n"
            "def src(w, n):\n"
            "    while True:\n"
            "        yield torch.zeros(4)\n"
            "it = prefetch(src, 2, workers=2, mode='process')\n"
            "next(it)\n"
            "print(' '.join(str(p.pid) for p in mp.active_children()), flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=str(REPO))
    pids = [int(x) for x in proc.stdout.readline().split()]
    assert len(pids) == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"

    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


def test_auto_feeds_a_cpu_and_small_accelerator_batches_from_threads_and_large_ones_from_processes(stores, monkeypatch):
    """``train.prefetch_mode = "auto"`` and ``train.prefetch_workers = "auto"`` (the defaults) by the
    rule measured in docs/performance.md: on a CPU one thread always; on an accelerator two workers,
    threads below 12 MiB a batch, processes from there. An explicit setting is kept."""
    from zgcore.config.defaults import DEFAULTS
    from zgcore.data import feed

    assert DEFAULTS["train"]["prefetch_mode"] == DEFAULTS["train"]["prefetch_workers"] == "auto"
    assert feed.resolve_feed("auto", "auto", 16_800_000, False) == ("thread", 1)
    assert feed.resolve_feed("auto", "auto", 9_400_000, True) == ("thread", 2)
    assert feed.resolve_feed("auto", "auto", 16_800_000, True) == ("process", 2)
    assert feed.resolve_feed("process", 3, 0, False) == ("process", 3)
    assert feed.resolve_feed("thread", "auto", 16_800_000, True) == ("thread", 2)
    assert [feed.choose_mode(b, False) for b in (0, 9_400_000, 16_800_000, 1 << 40)] == ["thread"] * 4
    assert [feed.choose_mode(b, True) for b in (9_400_000, (12 << 20) - 1, 12 << 20, 16_800_000)] == \
        ["thread", "thread", "process", "process"]
    with BoundaryReader(stores["bfloat16"]) as r:  # 3 sequences x 2 arrays x 16 tokens x 64 wide x 2 bytes
        hidden = int(r.manifest["hidden_size"])
        assert feed.stored_batch_bytes(r, 3, 2) == 3 * 2 * 16 * hidden * 2
        picked = []
        real = feed.prefetch
        monkeypatch.setattr(feed, "prefetch", lambda *a, **k: picked.append(a[3:5]) or real(*a, **k))
        got = [(s, idx.tolist(), x.clone(), y.clone()) for s, idx, x, y in
               feed.block_batches(r, 0, 2, r.n("train"), 0, 3, 0, 5, 2, False, "auto", "auto")]
        want = [(s, idx.tolist(), x.clone(), y.clone()) for s, idx, x, y in
                feed.store_batches(r, 0, 2, r.n("train"), 0, 3, 0, 5)]
    assert picked == [(1, "thread")]
    assert [(s, i) for s, i, _, _ in got] == [(s, i) for s, i, _, _ in want]
    assert all(torch.equal(a, b) and torch.equal(c, d) for (_, _, a, c), (_, _, b, d) in zip(got, want))
    with pytest.raises(ValueError, match="prefetch mode"):
        next(real(lambda w, n: iter(()), 2, mode="auto"))  # resolved before prefetch, never inside it


def test_the_reader_reuses_a_batch_tensor_only_when_nothing_refers_to_it(stores):
    """The reader writes a batch into memory it handed out before only when the consumer has let go
    of it (Python references, views, autograd), and never into a tensor sent to another process."""
    with BoundaryReader(stores["float32"]) as r:
        a = r.read("train", 0, [0, 1])
        ref, ptr = a.clone(), a.data_ptr()
        del a
        b = r.read("train", 0, [2, 3])
        assert b.data_ptr() == ptr  # reused: nothing referred to it
        view = b[1]
        c = r.read("train", 0, [0, 1])
        assert c.data_ptr() != ptr and torch.equal(c, ref) and torch.equal(view, r.read("train", 0, [3])[0])
        del b, view
        sent = c.share_memory_().data_ptr()  # what torch does to a tensor it sends to another process
        del c
        got = [r.read("train", 0, [2, 3]) for _ in range(3)]
        assert got[0].data_ptr() == ptr and all(g.data_ptr() != sent for g in got)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_reads_in_any_order_give_the_stored_bytes_in_the_storage_dtype(stores, dtype):
    path = stores[dtype]
    with BoundaryReader(path) as r:
        ref = []  # each sequence read alone with h5py from its shard file, through from_storage
        for sh in r.shards["train"]:
            with h5py.File(r._shard_dir(sh) / "b2.h5", "r") as f:
                ref += [from_storage(f["h"][i], dtype) for i in range(sh["hi"] - sh["lo"])]
        ref = torch.stack(ref)
        for idx in ([3, 4, 5, 6, 7], [10, 0, 7, 7, 2, 9, 8], list(range(11)), list(range(10, -1, -1)), [5], []):
            got = r.read("train", 2, idx)
            assert got.dtype == TORCH_DTYPES[dtype] and got.shape == (len(idx), 16, ref.shape[-1])  # not widened
            assert torch.equal(got.float(), ref[idx])  # runs across shard edges, repeats, reversed order: exact
        with pytest.raises(IndexError):
            r.read("train", 2, [11])


def test_short_reads_are_read_on_and_a_truncated_file_is_named(stores, tmp_path, monkeypatch):
    """os.preadv may return fewer bytes than asked (signals, network file systems): the reader reads
    on, and only a read that returns nothing (the file ends early) counts as damage."""
    import os
    import shutil

    path = tmp_path / "store"
    shutil.copytree(stores["float32"], path)
    with BoundaryReader(path) as r:
        ref = r.read("train", 2, list(range(11)))
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: real(fd, [memoryview(bufs[0])[:1000]], off))
    with BoundaryReader(path) as r:
        assert torch.equal(r.read("train", 2, list(range(11))), ref)  # 1,000 bytes at a time: the same bytes
        r.read("train", 2, [0])  # opens the file (SHA-256 checked), then it loses its end
        f = r._shard_dir(r.shards["train"][0]) / "b2.h5"
        with h5py.File(f, "r") as h:  # cut the file inside sequence 3's bytes
            cut = h["h"].id.get_offset() + 3 * h["h"][0].nbytes + 100
        with open(f, "r+b") as fh:
            fh.truncate(cut)
        with pytest.raises(BoundaryStoreError, match=f"{f}: short read: .* at sequence 3"):
            r.read("train", 2, [3])


# -- prefetching in a training task

CFG = tiny_cfg(**{"train.max_steps": 30, "train.batch_size": 3, "train.checkpoint_every": 10,
                  "boundary.shard_sequences": 32, "train.objective": "noisy"})


def blocks(out):
    return {p.parent.name: p.read_bytes() for p in sorted(Path(out).glob("TrainBlock/*/block.safetensors"))}


def test_prefetch_on_and_off_give_the_same_block_bytes_and_hash(tmp_path, run_graph):
    runs = {}
    for ahead, workers, mode in ((0, 1, "thread"), (1, 1, "thread"), (4, 3, "thread"), (2, 2, "process"), (3, 1, "auto")):
        cfg = CFG + f" train.prefetch={ahead} train.prefetch_workers={workers} train.prefetch_mode={mode}"
        assert run_graph(RunExperiment(preset="", set=cfg, outputs=str(tmp_path / f"p{ahead}")))[0]
        runs[ahead] = blocks(tmp_path / f"p{ahead}")
    assert len(runs[0]) == 2 and runs[0] == runs[1] == runs[4] == runs[2] == runs[3]  # same folder names (unhashed) and bytes
    rng = {a: [torch.load(p, weights_only=True)["torch_rng"] for p in sorted((tmp_path / f"p{a}").glob("TrainBlock/*/train_state.pt"))]
           for a in runs}
    assert all(torch.equal(x, y) for a in (1, 4, 2, 3) for x, y in zip(rng[0], rng[a]))  # the final state records the same RNG
    off = CFG + " train.prefetch=0 train.prefetch_workers=2 train.prefetch_mode=process train.tensorboard=false"
    assert {t.uid for t in tasks_of(off, tmp_path, "TrainBlock")} == {t.uid for t in tasks_of(CFG, tmp_path, "TrainBlock")}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_batches_widened_on_the_device_train_the_bytes_of_batches_widened_on_the_cpu(tmp_path, run_graph,
                                                                                           monkeypatch, dtype):
    """A 16-bit store's batches cross to the device as stored and are widened there; widening is
    exact, so the blocks are bitwise those trained from the same batches widened to float32 on
    the CPU by the reader (what it did before; a prefetch worker is forked and inherits the patch)."""
    cfg = CFG + f" boundary.dtype={dtype} train.prefetch=2"
    assert run_graph(RunExperiment(preset="", set=cfg, outputs=str(tmp_path / "native")))[0]
    native = blocks(tmp_path / "native")
    seen = []
    read = BoundaryReader.read

    def widened(self, *args, **kwargs):
        x = read(self, *args, **kwargs)
        seen.append(x.dtype)
        return x.float()

    monkeypatch.setattr(BoundaryReader, "read", widened)
    for ahead in (0, 2):
        out = tmp_path / f"widened{ahead}"
        assert run_graph(RunExperiment(preset="", set=cfg + f" train.prefetch={ahead}", outputs=str(out)))[0]
        assert blocks(out) == native  # same folder names (the config is the same) and the same bytes
    assert set(seen) == {TORCH_DTYPES[dtype]}  # the patch was used (in this process: prefetch 0) on 16-bit reads
    assert len(native) == 2
    if dtype == "bfloat16":  # the test can tell the dtypes apart: a float32 store trains other bytes
        out = tmp_path / "float32"
        assert run_graph(RunExperiment(preset="", set=CFG + " boundary.dtype=float32", outputs=str(out)))[0]
        assert all(a != b for a, b in zip(native.values(), blocks(out).values()))


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_damaged_shard_read_by_the_prefetch_worker_fails_the_block_naming_it(tmp_path, run_graph, mode):
    out = tmp_path / "out"
    cfg = CFG + f" train.prefetch=3 train.max_steps=2 train.prefetch_mode={mode}"
    assert run_graph(RunExperiment(preset="", set=cfg, outputs=str(out)))[0]
    f = next((out / "BoundaryShard").glob("train-00000032-*")) / "b2.h5"
    with h5py.File(f, "r") as h:
        offset = h["h"].id.get_offset() + 5 * h["h"][0].nbytes  # contiguous: sequence 5's bytes
    raw = bytearray(f.read_bytes())
    raw[offset + 64] ^= 0x01
    f.write_bytes(bytes(raw))
    FAILURES.clear()
    cfg = CFG + f" train.prefetch=3 train.max_steps=30 train.prefetch_mode={mode}"  # 30 batches of 3 read every sequence
    assert not run_graph(RunExperiment(preset="", set=cfg, outputs=str(out)))[0]
    msgs = [m for fam, m in FAILURES if fam == "TrainBlock"]
    assert msgs and msgs[0].startswith(f"boundary shard file {f.resolve()}: checksum failure")
    assert list((out / "BoundaryShard").glob("train-00000032-*.damaged-*"))  # moved aside to be rebuilt
    assert not tasks_of(cfg, out, "TrainBlock")[1].out_dir.exists()


# -- TensorBoard

def _scalars(run: Path) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run))
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_runs_fill_while_the_tasks_train_one_run_per_task(tmp_path, run_graph, monkeypatch):
    import tasks.base
    import zgcore.training.watch

    monkeypatch.setattr(zgcore.training.watch, "FLUSH_SECONDS", 0.05)
    out = tmp_path / "out"
    seen = {}
    progress = tasks.base.ZGTask.progress

    def peek(self, done, total, message=""):  # in the middle of a training task: what is on disk now?
        if self.get_task_family() in ("TrainBlock", "Heal") and done == 4 and self.get_task_family() not in seen:
            time.sleep(0.3)  # two flush periods of the writer's thread
            seen[self.get_task_family()] = (self.out_dir.exists(), _scalars(self.tensorboard_dir))
        return progress(self, done, total, message)

    monkeypatch.setattr(tasks.base.ZGTask, "progress", peek)
    cfg = CFG + " train.max_steps=8 heal.steps=6 heal.checkpoint_every=3"
    assert run_graph(RunExperiment(preset="", set=cfg, outputs=str(out)))[0]
    for fam in ("TrainBlock", "Heal"):
        done, scalars = seen[fam]
        assert not done  # the task was still running
        assert scalars["loss/loss"][:3] == [1, 2, 3] and "lr" in scalars and "grad_norm" in scalars
        assert "throughput/tokens_per_s" in scalars
    runs = sorted(p.relative_to(out / "tensorboard").as_posix() for p in (out / "tensorboard").glob("*/*/*"))
    blocks_ = tasks_of(cfg, out, "TrainBlock")
    name = "default"  # the experiment's name (no preset: the default's) comes first, so a reader tells experiments apart
    assert runs == sorted([f"{name}/Heal/{tasks_of(cfg, out, 'Heal')[0].out_dir.name}"] +
                          [f"{name}/TrainBlock/{t.out_dir.name}" for t in blocks_])
    final = _scalars(blocks_[0].tensorboard_dir)
    assert final["loss/loss"] == list(range(1, 9)) and final["lr"] == list(range(1, 9))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(blocks_[0].tensorboard_dir))
    acc.Reload()
    log = np.loadtxt(blocks_[0].out_dir / "loss_log.csv", delimiter=",", skiprows=1)
    assert np.allclose([e.value for e in acc.Scalars("loss/loss")], log[:, 1], rtol=1e-6)  # the loss log's values

    off = tmp_path / "off"
    assert run_graph(RunExperiment(preset="", set=cfg + " train.tensorboard=false heal.tensorboard=false",
                                   outputs=str(off)))[0]
    assert not (off / "tensorboard").exists()
    assert sorted(p.name for p in off.glob("TrainBlock/*")) == sorted(p.name for p in out.glob("TrainBlock/*"))


def test_the_end_to_end_arm_and_local_learning_write_their_runs_too(tmp_path, run_graph):
    from workflows import load_config
    from workflows.distill import build_distill_study
    from workflows.local import LocalLearningStudy

    study = build_distill_study(load_config("", "heal.steps=0", "distill_tiny"), str(tmp_path))
    e2e = study.requires()["e2e"].requires()["model"]
    assert run_graph(e2e)[0]
    tags = _scalars(e2e.tensorboard_dir)
    steps = len((e2e.out_dir / "loss_log.csv").read_text().splitlines()) - 1
    assert tags["loss/kd"] == tags["loss/hidden"] == tags["grad_norm"] == list(range(1, steps + 1))
    assert [p.parent.relative_to(tmp_path / "tensorboard").as_posix() for p in (tmp_path / "tensorboard").glob("*/*/*")] \
        == ["distill-tiny/DistillE2E"]

    out = tmp_path / "local"
    over = "study.K=[1,2] study.aux=[mlp] study.mtp=[off]"
    assert run_graph(LocalLearningStudy(preset="local_tiny", set=over, outputs=str(out)))[0]
    studies = [p.name for p in (out / "tensorboard").iterdir()]
    assert studies == ["local-tiny"]  # runs are named by the study, then the task family, then the arm
    runs = sorted((out / "tensorboard" / "local-tiny" / "PretrainLocal").iterdir())
    assert [r.name.split("-")[0] for r in runs] == ["K1", "K2"]  # one run per configuration
    tags = _scalars(runs[1])
    assert tags["loss/ce_b1"] == tags["loss/ce_b2"] == list(range(1, 9)) and "loss/mtp_b1" not in tags  # NaN: skipped
    assert tags["grad_norm/group0"] == tags["grad_norm/group1"] == list(range(1, 9))  # one per gradient-isolated block
    off = tmp_path / "local-off"
    assert run_graph(LocalLearningStudy(preset="local_tiny", set=over + " train.tensorboard=false", outputs=str(off)))[0]
    assert not (off / "tensorboard").exists()
    assert sorted(p.name for p in off.glob("PretrainLocal/*")) == sorted(p.name for p in out.glob("PretrainLocal/*"))
