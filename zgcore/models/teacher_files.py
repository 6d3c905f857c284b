"""What a teacher's files are, checked before anything loads them: a GGUF file, a safetensors file
and a ``config.json`` that are not what they claim fail in one line saying what the file is (its
first bytes, and what they look like) or, for a file of the right kind that is cut short or damaged,
where the read stopped.

Reads headers only (a GGUF's metadata and tensor table, a safetensors file's JSON header), never
tensor data: a check costs what the headers cost, whatever the size of the weights. Formats: GGUF v2/v3
(``ggml-org/ggml`` docs/gguf.md), safetensors (an 8-byte little-endian header length, a JSON header,
then the data; ``huggingface/safetensors`` README).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path

from zgcore.checks import ConfigError

GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_HEADER = 1 << 30  # a header (GGUF metadata, safetensors JSON) larger than this is damage, not a model


def looks_like(head: bytes) -> str:
    """A short description of what a file starting with ``head`` is: ``"a GGUF file"``, ``"a
    safetensors file"``, ``"a zip archive (a PyTorch .bin/.pt?)"``, ``"JSON text"``, ``"an HDF5
    file"``, ``"text"``, ``"empty"``, or ``"unrecognised binary data"``."""
    if not head:
        return "empty"
    if head.startswith(GGUF_MAGIC):
        return "a GGUF file"
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive (a PyTorch .bin/.pt?)"
    if head.startswith(b"\x89HDF"):
        return "an HDF5 file"
    if len(head) >= 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] < _MAX_HEADER:
        return "a safetensors file"
    text = head.lstrip()
    if text[:1] in (b"{", b"["):
        return "JSON text"
    try:
        head.decode("utf-8")
        return "text"
    except UnicodeDecodeError:
        return "unrecognised binary data"


def first_bytes(path: Path, n: int = 16) -> tuple[bytes, str]:
    """``(the first n bytes, "its first bytes are 47 47 55 46 ... ('GGUF...'), <looks_like>")``."""
    with open(path, "rb") as f:
        head = f.read(max(n, 64))
    shown = head[:n]
    text = "".join(chr(b) if 32 <= b < 127 else "." for b in shown)
    return head, f"its first bytes are {shown.hex(' ') or '(none)'} ({text!r}): {looks_like(head)}"


class _Reader:
    """Sequential little-endian reads of a file (memory-mapped) that say where they stopped."""

    def __init__(self, path: Path):
        self.path, self.size, self.at = path, os.path.getsize(path), 0
        with open(path, "rb") as f:
            self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.at + n > self.size:
            raise ConfigError(
                f"teacher GGUF file {self.path} is cut short or damaged: the read stopped at byte {self.at} "
                f"of {self.size} reading {what} ({n} bytes wanted)"
            )
        self.at += n
        return self.buf[self.at - n : self.at]

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        if self.at + n > self.size:
            self.take(n, what)
        v = struct.unpack_from(fmt, self.buf, self.at)[0]
        self.at += n
        return v

    def skip(self, n: int, what: str) -> None:
        if n < 0 or self.at + n > self.size:
            self.take(n, what)
        self.at += n

    def string(self, what: str) -> str:
        n = self.unpack("<Q", f"the length of {what}")
        if n > _MAX_HEADER:
            raise ConfigError(
                f"teacher GGUF file {self.path} is damaged: {what} at byte {self.at - 8} claims "
                f"{n} bytes (file of {self.size})"
            )
        return bytes(self.take(n, what)).decode("utf-8", errors="replace")

    def value(self, kind: int, what: str, depth: int = 0) -> None:
        if kind in _SCALARS:
            self.unpack(_SCALARS[kind], what)
        elif kind == _STRING:
            self.skip(self.unpack("<Q", f"the length of {what}"), what)
        elif kind == _ARRAY and depth == 0:
            item = self.unpack("<I", f"the item type of {what}")
            count = self.unpack("<Q", f"the length of {what}")
            if item in _SCALARS:  # skip a scalar array in one step (a vocabulary's scores: 49k floats)
                self.skip(count * struct.calcsize(_SCALARS[item]), what)
            elif item == _STRING:  # a vocabulary: tens of thousands of strings, walked without building names
                at, size, buf = self.at, self.size, self.buf
                for i in range(count):
                    if at + 8 > size or at + 8 + struct.unpack_from("<Q", buf, at)[0] > size:
                        self.at = at
                        self.take(size + 1, f"{what}, item {i} of {count}")
                    at += 8 + struct.unpack_from("<Q", buf, at)[0]
                self.at = at
            else:
                for i in range(count):
                    self.value(item, f"{what}[{i}]", depth + 1)
        else:
            raise ConfigError(
                f"teacher GGUF file {self.path} is damaged: {what} has value type {kind} at byte "
                f"{self.at - 4} (not a GGUF type)"
            )


def check_gguf(path: str | os.PathLike) -> None:
    """Check that ``path`` is a whole GGUF file: magic, version, every metadata entry, every tensor's
    table entry, and every tensor's data within the file (headers only are read).

    Raises:
        ConfigError: not GGUF (its first bytes and what they look like), or cut short or damaged
            (where the read stopped and what it was reading)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    head, said = first_bytes(path)
    if not head.startswith(GGUF_MAGIC):
        raise ConfigError(f"teacher file {path} is not a GGUF file: {said}")
    r = _Reader(path)
    try:
        r.take(4, "the magic")
        version = r.unpack("<I", "the version")
        if version not in (2, 3):
            raise ConfigError(f"teacher GGUF file {path} has version {version}; this reads GGUF versions 2 and 3")
        n_tensors, n_kv = r.unpack("<Q", "the tensor count"), r.unpack("<Q", "the metadata count")
        alignment = 32
        for i in range(n_kv):
            key = r.string(f"metadata key {i} of {n_kv}")
            kind = r.unpack("<I", f"the type of metadata {key!r}")
            if key == "general.alignment" and kind == 4:
                alignment = r.unpack("<I", f"metadata {key!r}") or 32
            else:
                r.value(kind, f"metadata {key!r}")
        ends = []
        for i in range(n_tensors):
            name = r.string(f"tensor name {i} of {n_tensors}")
            n_dims = r.unpack("<I", f"the dimensions of tensor {name!r}")
            shape = [r.unpack("<Q", f"the shape of tensor {name!r}") for _ in range(min(n_dims, 8))]
            kind = r.unpack("<I", f"the type of tensor {name!r}")
            offset = r.unpack("<Q", f"the offset of tensor {name!r}")
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise ConfigError(
                    f"teacher GGUF file {path} is damaged: tensor {name!r} has type {kind} (not a GGML type)"
                ) from None
            count = 1
            for d in shape:
                count *= d
            ends.append((offset + count // block * type_size, name))
        data = -(-r.at // alignment) * alignment
        for end, name in ends:
            if data + end > r.size:
                raise ConfigError(
                    f"teacher GGUF file {path} is cut short: tensor {name!r} ends at byte {data + end}, "
                    f"the file holds {r.size}"
                )
    finally:
        r.buf.close()


def check_safetensors(path: str | os.PathLike) -> None:
    """Check that ``path`` is a whole safetensors file: its header length, its JSON header, and every
    tensor's data within the file (the header only is read).

    Raises:
        ConfigError: not safetensors (its first bytes), or cut short or damaged (where the read stopped)."""
    path = Path(path)
    size = os.path.getsize(path)
    head, said = first_bytes(path)
    n = struct.unpack("<Q", head[:8])[0] if len(head) >= 8 else None
    if n is None or n > _MAX_HEADER or head[8:9] != b"{":
        raise ConfigError(f"teacher weights {path} are not a safetensors file: {said}")
    if 8 + n > size:
        raise ConfigError(
            f"teacher weights {path} are cut short: the read stopped at byte {size} of a {8 + n}-byte header"
        )
    with open(path, "rb") as f:
        f.seek(8)
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ConfigError(f"teacher weights {path} are damaged: their header does not parse ({e})") from None
    data = size - 8 - n
    for name, t in header.items():
        if name != "__metadata__" and isinstance(t, dict) and t.get("data_offsets", [0, 0])[1] > data:
            raise ConfigError(
                f"teacher weights {path} are cut short: tensor {name!r} ends at byte "
                f"{8 + n + t['data_offsets'][1]}, the file holds {size}"
            )


def check_config_json(path: str | os.PathLike) -> None:
    """Check that a teacher's ``config.json`` is a JSON object.

    Raises:
        ConfigError: it is not JSON (its first bytes, where the parse stopped) or not an object."""
    path = Path(path)
    try:
        cfg = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        _, said = first_bytes(path)
        where = (
            f"the parse stopped at line {e.lineno}, column {e.colno} (byte {e.pos})" if hasattr(e, "pos") else str(e)
        )
        raise ConfigError(f"teacher config {path} is not JSON: {where}; {said}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"teacher config {path} holds a JSON {type(cfg).__name__}, not an object of settings")
