"""Checkpoint files of :class:`zgcore.training.loop.TrainLoop`: their content digest, and loading
one safely (``weights_only``; a malformed file is moved aside, never deleted; a transient read
error keeps it)."""
from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Mapping

import torch

from zgcore.atomic import set_aside

# 3: {"format", "modules", "optimizers", "torch_rng", "step", "log", "run_hash", "digest"}, weights_only;
# "digest" (state_digest of the rest) is checked on load: torch.load does not check its zip's CRCs
CKPT_FORMAT = 3
_CKPT_FIELDS = {"format", "modules", "optimizers", "torch_rng", "step", "log", "run_hash", "digest"}


def state_digest(obj: Any) -> str:
    """SHA-256 (hex) of a checkpoint's content: every tensor's dtype, shape and bytes and every
    plain value's ``repr``, walking dicts in sorted key order. Computed on save and compared on
    load, so a damaged file never resumes training with other values (``torch.load`` reads a
    checkpoint's zip records without checking their CRC-32: a flipped byte in a tensor loads
    silently)."""
    import hashlib

    h = hashlib.sha256()

    def walk(o):
        if isinstance(o, torch.Tensor):
            t = o.detach().cpu().contiguous().reshape(-1)
            h.update(f"T{t.dtype}{tuple(o.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
        elif isinstance(o, Mapping):
            h.update(f"D{len(o)}".encode())
            for k in sorted(o, key=repr):
                h.update(repr(k).encode())
                walk(o[k])
        elif isinstance(o, (list, tuple)):
            h.update(f"L{len(o)}".encode())
            for x in o:
                walk(x)
        else:
            h.update(f"V{o!r}".encode())

    walk(obj)
    return h.hexdigest()


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """Load a checkpoint onto the CPU with ``weights_only=True``; ``None`` if there is none.

    A file that is malformed (not a checkpoint, truncated, of another format, holding anything but
    tensors and plain values, or whose content does not match its :func:`state_digest`) is moved aside to ``*.corrupt-<time>`` (never deleted; a second one gets ``-2``, ``-3``...) and ``None`` is
    returned. CPU, whatever the training device: ``torch.set_rng_state`` takes only a CPU
    ``ByteTensor``, and ``load_state_dict`` copies weights and optimizer state to the device.

    Raises:
        OSError: the file exists but could not be read (a transient I/O error); it is kept as it is.
    """
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise OSError(e.errno, f"checkpoint {path} could not be read ({e}); it is kept: rerun when the "
                               f"file system answers again") from e
    except Exception as e:  # truncated zip, unpickling refused, garbage bytes...
        return _move_aside(path, e)
    if not isinstance(ck, dict) or ck.get("format") != CKPT_FORMAT or _CKPT_FIELDS - set(ck):
        return _move_aside(path, ValueError(f"not a format-{CKPT_FORMAT} checkpoint"))
    if state_digest({k: v for k, v in ck.items() if k != "digest"}) != ck["digest"]:
        return _move_aside(path, ValueError("its content does not match the digest written with it (damaged bytes)"))
    return ck


def _move_aside(path: Path, e: Exception) -> None:
    bad = set_aside(path, "corrupt")  # <name>.corrupt-<time>[-n]: a second bad checkpoint never replaces the first
    if bad is None:
        raise OSError(f"checkpoint {path} is malformed ({type(e).__name__}) and could not be moved aside; "
                      f"move or delete it, then rerun")
    print(f"checkpoint {path} is malformed ({type(e).__name__}: {str(e)[:200]}); moved to {bad}, starting from step 0",
          flush=True)
    return None
