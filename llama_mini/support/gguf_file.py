"""GGUF files read trusting nothing in them: the metadata and the tensor table first, then each
tensor's data only when it is asked for.

The layout (llama.cpp's ggml/docs/gguf.md, versions 2 and 3, little-endian): the magic "GGUF",
the version, the tensor count and the metadata count; each metadata entry as a key, a value
type and a value (a number, a string, or an array of either); each tensor as its name, its
dims (innermost first), its GGML type and its offset; padding to general.alignment; the data.

gguf's GGUFReader reads the same layout, but it believes every count before the bytes behind
it exist and makes a numpy array of every element of every array (a Llama-3 vocabulary is
four hundred thousand strings), so a lying count costs unbounded time and memory and a real
vocabulary costs seconds. Here every count and length is checked against the bytes left in
the file before anything is built, arrays of numbers are views of the mapped file, and a
tensor is dequantized by gguf.quants (llama.cpp's own code, in numpy) a slice of rows at a
time straight into the tensor it becomes.
"""

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, quants

from .files import GGUF_MAGIC, brief

VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
# The most strings one metadata array may hold: Llama-3 has 128,256 tokens and 280,147 merges;
# the largest vocabularies in use have about 256,000 tokens and half a million merges.
MAX_STRINGS = 1 << 21
T = GGMLQuantizationType
FLOATS = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}  # read as they are stored
QUANTIZED = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)  # dequantized
_SCALARS = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4", GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "<u1",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}
_LENGTH = struct.Struct("<Q")  # a string's length
_CHUNK_ELEMENTS = 1 << 20  # the rows dequantized at once: a few MB of float32 beside the result
_STEPPED_OVER = object()  # an array of strings left out (string_arrays=False)
MADV_POPULATE_READ = 22  # Linux's number (Python's mmap names it from 3.13 on)


@dataclass(frozen=True)
class TensorInfo:
    type: GGMLQuantizationType
    shape: tuple  # PyTorch's order: outermost first
    numel: int
    start: int  # byte offset of the data in the file
    nbytes: int


class GGUFFile:
    """A GGUF file's metadata (fields: key -> value; value_types: key -> (type, array item type or
    None)), its tensors (tensors: name -> TensorInfo) and tensor(name, dtype) for the data.

    Values are Python ints, floats, bools and strings; arrays of strings are lists, arrays of
    numbers numpy views of the file. A float32 value is read as the shortest decimal that gives
    it back (1e-05, not 9.99999974738e-06): the number the writer had.

    string_arrays=False leaves the arrays of strings (the vocabulary, which the tokenizer reads) out
    of fields: their lengths are checked and stepped over and no string is made, so that loading
    the model does not read the vocabulary a second time.
    """

    def __init__(self, path, string_arrays: bool = True):
        self.path, self.string_arrays = Path(path), string_arrays
        with open(self.path, "rb") as f:
            if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
                raise ValueError(f"{self.path} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
            # A private, copy-on-write map: tensors are views of it that torch may write to.
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.pos = len(GGUF_MAGIC)
        (version,) = self._unpack("<I")
        if version not in VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big") in VERSIONS
            raise ValueError(f"{self.path} is a GGUF file of version {version}"
                             f"{' written big-endian' if swapped else ''}; llama_mini reads little-endian versions 2 and 3")
        n_tensors, n_fields = self._unpack("<QQ")
        self.fields, self.value_types = {}, {}
        self._check_count(n_fields, 8 + 4 + 1, "metadata entries")  # the smallest: an empty key, a type, one byte
        for _ in range(n_fields):
            key = self._string()
            if key in self.fields:
                raise self._corrupt(f"the metadata key {key[:80]!r} appears twice")
            (kind,) = self._unpack("<I")
            value, self.value_types[key] = self._value(kind, key)
            if value is not _STEPPED_OVER:
                self.fields[key] = value
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if self.value_types.get("general.alignment", (GGUFValueType.UINT32,))[0] != GGUFValueType.UINT32 or \
                alignment < 1 or alignment & (alignment - 1):
            raise self._corrupt(f"general.alignment is {alignment!r}, not a power of two")
        self._check_count(n_tensors, 8 + 4 + 8 + 4 + 8, "tensors")  # an empty name, one dim, type, offset
        infos = [self._tensor_info() for _ in range(n_tensors)]
        data_start = -(-self.pos // alignment) * alignment
        self.tensors = {}
        for name, dims, kind, offset in infos:
            if name in self.tensors:
                raise self._corrupt(f"tensor {name[:80]!r} appears twice")
            if offset % alignment:  # llama.cpp places every tensor at a multiple of the alignment
                raise self._corrupt(f"tensor {name[:80]!r} starts at offset {offset}, not a multiple of "
                                    f"general.alignment {alignment}")
            self.tensors[name] = self._tensor_layout(name, dims, kind, data_start + offset)
        in_order = sorted(self.tensors.items(), key=lambda item: item[1].start)
        for (first, a), (second, b) in zip(in_order, in_order[1:]):
            if a.start + a.nbytes > b.start:
                raise self._corrupt(f"tensors {first[:80]!r} and {second[:80]!r} overlap")

    # --- Metadata --------------------------------------------------------------------------

    def _corrupt(self, why: str) -> ValueError:
        return ValueError(f"{self.path} is truncated or corrupt ({why}); download or convert it again")

    def _unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.map):
            raise self._corrupt(f"it ends inside the header, at byte {len(self.map)}")
        values = struct.unpack_from(fmt, self.map, self.pos)
        self.pos += size
        return values

    def _check_count(self, count: int, min_bytes: int, what: str) -> None:
        """A count is believed only if the bytes left could hold that many of the smallest item."""
        if count * min_bytes > len(self.map) - self.pos:
            raise self._corrupt(f"it claims {count} {what}, more than its {len(self.map)} bytes can hold")

    def _string(self) -> str:
        return self._strings(1)[0]

    def _strings(self, count: int, made: bool = True) -> list:
        """count strings, each its length and its UTF-8 bytes, checked against the bytes left: in one
        loop, as a vocabulary is hundreds of thousands of them. made=False steps over them."""
        strings, data, pos, end = [], self.map, self.pos, len(self.map)
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                self._unpack("<Q")  # says where the file ends
            (length,) = _LENGTH.unpack_from(data, pos)
            pos += 8
            if length > end - pos:
                raise self._corrupt(f"a string of {length} bytes at byte {pos} runs past the end")
            if made:
                try:
                    strings.append(data[pos : pos + length].decode("utf-8"))
                except UnicodeDecodeError:
                    raise self._corrupt(f"a string at byte {pos} is not UTF-8") from None
            pos += length
        self.pos = pos
        return strings

    def _value(self, kind: int, key: str):
        """(value, (its type, the array's item type or None)) of the value at the current position."""
        kind = self._value_type(kind, key)
        if kind == GGUFValueType.STRING:
            return self._string(), (kind, None)
        if kind != GGUFValueType.ARRAY:
            (value,) = self._numbers(kind, 1).tolist()
            return _python_number(value, kind), (kind, None)
        item, count = self._unpack("<IQ")
        item = self._value_type(item, key)
        if item == GGUFValueType.ARRAY:
            raise ValueError(f"{self.path}: metadata {key[:80]!r} is an array of arrays, which llama.cpp does not read either")
        if item == GGUFValueType.STRING:
            self._check_count(count, 8, f"strings in {key[:80]!r}")
            if count > MAX_STRINGS:  # refused before a Python string is made of each (about 60 bytes apiece)
                raise self._corrupt(f"{key[:80]!r} holds {count} strings, more than any tokenizer's vocabulary "
                                    f"or merges ({MAX_STRINGS})")
            strings = self._strings(count, self.string_arrays)
            return strings if self.string_arrays else _STEPPED_OVER, (kind, item)
        return self._numbers(item, count), (kind, item)

    def _value_type(self, kind: int, key: str) -> GGUFValueType:
        try:
            return GGUFValueType(kind)
        except ValueError:
            raise self._corrupt(f"metadata {key[:80]!r} has value type {kind}, which GGUF does not define") from None

    def _numbers(self, kind: GGUFValueType, count: int) -> np.ndarray:
        dtype = np.dtype(_SCALARS[kind])
        self._check_count(count, dtype.itemsize, f"{kind.name} values")
        values = np.frombuffer(self.map, dtype, count, self.pos)
        self.pos += count * dtype.itemsize
        return values.astype(bool) if kind == GGUFValueType.BOOL else values

    # --- Tensors ---------------------------------------------------------------------------

    def _tensor_info(self):
        name = self._string()
        (n_dims,) = self._unpack("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise self._corrupt(f"tensor {name[:80]!r} has {n_dims} dimensions, not 1 to {MAX_DIMS}")
        dims = self._unpack(f"<{n_dims}Q")
        kind, offset = self._unpack("<IQ")
        return name, dims, kind, offset

    def _tensor_layout(self, name: str, dims, kind: int, start: int) -> TensorInfo:
        try:
            kind = GGMLQuantizationType(kind)
        except ValueError:
            raise self._corrupt(f"tensor {name[:80]!r} has type {kind}, which GGML does not define") from None
        block, block_bytes = GGML_QUANT_SIZES[kind]
        if dims[0] % block:
            raise self._corrupt(f"tensor {name[:80]!r} has rows of {dims[0]} values, not whole {kind.name} blocks of {block}")
        n = 1
        for size in dims:  # Python integers: a product past 2**64 is seen, not wrapped
            n *= size
        nbytes = n // block * block_bytes
        if start + nbytes > len(self.map):
            raise self._corrupt(f"tensor {name[:80]!r} ({kind.name}, {list(dims)}) ends at byte {start + nbytes}, "
                                f"past the end of the file at {len(self.map)}")
        return TensorInfo(kind, tuple(reversed(dims)), n, start, nbytes)

    def tensor(self, name: str, dtype=None) -> torch.Tensor:
        """The tensor called name: F32, F16 and BF16 as views of the mapped file (read from disk
        when first used); llama.cpp's quantized blocks dequantized to dtype (default float32)."""
        info = self.tensors[name]
        if info.type in FLOATS:
            stored = FLOATS[info.type]
            if info.numel == 0:
                return torch.empty(info.shape, dtype=stored)
            if info.start % stored.itemsize:  # a view needs aligned elements; llama.cpp aligns to 32 bytes
                return torch.frombuffer(bytearray(self.map[info.start : info.start + info.nbytes]), dtype=stored).view(info.shape)
            return torch.frombuffer(self.map, dtype=stored, count=info.numel, offset=info.start).view(info.shape)
        if info.type not in QUANTIZED:
            supported = ", ".join(t.name for t in (*FLOATS, *QUANTIZED))
            raise ValueError(f"{self.path} stores tensor {name} as {info.type.name}; llama_mini reads {supported}")
        out = torch.empty(info.shape, dtype=dtype or torch.float32)
        if info.numel == 0:
            return out
        rows, blocks = out.view(-1, info.shape[-1]), self.blocks(name)
        step = max(1, _CHUNK_ELEMENTS // rows.shape[1])
        with np.errstate(all="ignore"):  # a block may hold inf or NaN scales; the values say so, not a warning
            for i in range(0, len(rows), step):
                rows[i : i + step] = torch.from_numpy(quants.dequantize(blocks[i : i + step], info.type))
        return out


    def blocks(self, name: str) -> np.ndarray:
        """A quantized tensor's bytes as stored: uint8 (rows, bytes per row), a view of the mapped file."""
        info = self.tensors[name]
        rows = info.numel // info.shape[-1] if info.numel else 0
        return np.frombuffer(self.map, np.uint8, info.nbytes, info.start).reshape(rows, -1)

    def map_pages(self, name: str) -> None:
        """Map a tensor's pages into this process now, as llama.cpp maps its file, where the tensor
        is used as mapped: the first forward does not stop to fault them in one by one. Where the
        system cannot (MADV_POPULATE_READ: Linux 5.14 and later), they are mapped as first read."""
        info, page = self.tensors[name], mmap.PAGESIZE
        first = info.start // page * page
        try:
            self.map.madvise(MADV_POPULATE_READ, first, info.start + info.nbytes - first)
        except (OSError, ValueError):
            pass

    def release(self, name: str) -> None:
        """Drop the pages of a tensor read into a copy of its own: its bytes leave this process's
        memory (they are read from the file again should they be touched)."""
        info, page = self.tensors[name], mmap.PAGESIZE
        first, end = -(-info.start // page) * page, (info.start + info.nbytes) // page * page
        if end > first:
            self._drop(first, end - first)

    def keep_only(self, names) -> None:
        """Drop every page of the map but those of the tensors named (the layers that read the file
        where it is mapped). Reading a page maps the whole folio of the page cache around it, up to
        megabytes on recent kernels, so pages already let go come back beside those read later (a
        norm, the edge of a neighbour): once all is copied out, this lets them go for good."""
        page = mmap.PAGESIZE
        kept = sorted((info.start // page * page, -(-(info.start + info.nbytes) // page) * page)
                      for info in (self.tensors[name] for name in names))
        start = 0
        for first, end in [*kept, (len(self.map), len(self.map))]:
            if first > start:
                self._drop(start, first - start)
            start = max(start, end)

    def _drop(self, start: int, length: int) -> None:
        """Let pages go: read from the file again should they be touched. Where the system has no
        madvise (Windows), they stay."""
        if hasattr(self.map, "madvise"):
            self.map.madvise(mmap.MADV_DONTNEED, start, length)


def check_llama(fields: dict, source) -> None:
    """Refuse, in one line, a GGUF file of another architecture than llama.cpp's "llama" (the
    one its Llama-2, Llama-3.x, TinyLlama and llama2.c conversions write)."""
    arch = fields.get("general.architecture")
    if not (isinstance(arch, str) and arch == "llama"):
        raise ValueError(f"{source} holds a model of architecture {brief(arch)}; llama_mini reads GGUF files of "
                         "llama.cpp's llama architecture (Llama-2, Llama-3.x, TinyLlama, llama2.c exports)")


def _python_number(value, kind: GGUFValueType):
    if kind == GGUFValueType.BOOL:
        return bool(value)
    if kind == GGUFValueType.FLOAT32:
        return float(str(np.float32(value)))
    return value
