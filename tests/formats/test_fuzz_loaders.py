"""Fuzzing the loaders: whatever a checkpoint's files say, loading gives a model or one line of error.

hypothesis rewrites one part of a valid tiny checkpoint at a time: a safetensors header (its
length field, a tensor's dtype, shape or offsets), the fields of params.json, of a Hugging Face
config.json or of our own config.json, the weight_map of a shard index, the header of a
llama2.c .bin (its sizes, version, flags, or the file's length), and a GGUF file (any count,
length, type, dim or offset of its header, metadata and tensor table, a metadata value, a
missing key or vocabulary, or the file's length). Each example must end in one of two ways only:
- a loaded model, or
- a ValueError or OSError whose message is one line naming the file or folder (or, for a
  config that disagrees with its weights, the tensor that does not fit).
A GGUF file's vocabulary is opened too, and used, with the same two outcomes.
Any other exception fails, and so does memory: each kind of example runs in a child process
whose address space is capped (RLIMIT_AS) a little above what its imports use, so a loader that
believes a size in a file before checking it dies of MemoryError instead of paging the machine.

The examples are derandomized (the same on every run) and few enough to take seconds per kind.
"""

import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("safetensors_header", "params_json", "hf_config", "native_config", "shard_index", "llama2c_header", "gguf")
MEMORY_CAP_BYTES = 2**30  # beyond what the imports mapped; the tiny checkpoint needs a few MB
EXAMPLES_PER_KIND = 200
pytestmark = pytest.mark.slow  # hundreds of examples per kind, each kind in a child process


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc to size the memory cap")
@pytest.mark.parametrize("kind", KINDS)
def test_loader_gives_a_model_or_one_line_naming_the_file(kind):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}  # one thread: no stacks to map
    result = subprocess.run([sys.executable, __file__, kind], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    outcomes = json.loads(result.stdout.splitlines()[-1])
    # Both outcomes occur: the examples reach past the first check, and some still load.
    assert outcomes["loaded"] > 0 and outcomes["refused"] > 0 and sum(outcomes.values()) >= EXAMPLES_PER_KIND, outcomes


# --- The child: one kind of example under a memory cap ------------------------------------------


def run_child(kind: str) -> None:
    from hypothesis import HealthCheck, given, settings

    base = write_base_checkpoints(Path(tempfile.mkdtemp(prefix="fuzz-base-")))
    used = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (used + MEMORY_CAP_BYTES, resource.getrlimit(resource.RLIMIT_AS)[1]))
    outcomes = {"loaded": 0, "refused": 0}

    @settings(max_examples=EXAMPLES_PER_KIND, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(STRATEGIES[kind]())
    def fuzz(change):
        folder_name, apply = change
        with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
            folder = Path(tmp) / folder_name
            shutil.copytree(base / folder_name, folder)
            apply(folder)
            files = [folder / name for name in ("model.bin", "model.gguf") if (folder / name).exists()]
            target = files[0] if files else folder  # llama2.c and GGUF: a file
            outcomes[check_outcome(target)] += 1

    fuzz()
    print(json.dumps(outcomes))


def check_outcome(path: Path) -> str:
    """"loaded" or "refused", asserting that nothing else happened."""
    from llama_mini import Transformer, load_checkpoint

    if path.suffix == ".gguf":
        check_vocabulary(path)
    try:
        model = load_checkpoint(path)
    except (ValueError, OSError) as e:
        assert_one_line(e, path)
        return "refused"
    assert isinstance(model, Transformer)
    assert len({p.dtype for p in model.parameters()}) == 1
    return "loaded"


def assert_one_line(error: Exception, path: Path) -> None:
    message = str(error)
    assert "\n" not in message, message
    assert str(path) in message or message.startswith(("tensor ", "checkpoint does not fit")), message


def check_vocabulary(path: Path) -> None:
    """The vocabulary of a GGUF file opens and encodes, or is refused in one line."""
    from llama_mini.tokenizers import open_tokenizer

    try:
        tokenizer = open_tokenizer(path)
        tokenizer.decode(tokenizer.encode("Hi there, 42!", bos=True, eos=True))
        tokenizer.encode_dialog([{"role": "user", "content": "Hi"}])
    except (ValueError, OSError) as e:
        assert_one_line(e, path)


def write_base_checkpoints(root: Path) -> Path:
    """A tiny model as native, meta, hf (one file) and hf-sharded (with an index) folders."""
    import torch

    from llama_mini import ModelArgs, Transformer, save_checkpoint

    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=16, n_layers=2, n_heads=2, vocab_size=32, multiple_of=16, max_seq_len=32))
    for fmt in ("native", "meta", "hf"):
        save_checkpoint(model, root / fmt, format=fmt)
    save_checkpoint(model, root / "hf-sharded", format="hf", max_shard_bytes=4000)
    from llama2c_files import export  # llama2.c's export.py layout

    for version in (0, 1, 2):
        (root / f"llama2c-v{version}").mkdir()
        export(model, root / f"llama2c-v{version}" / "model.bin", version, group_size=16)
    write_base_gguf(root / "gguf")
    return root


def write_base_gguf(folder: Path) -> None:
    """A tiny Llama with GQA in Q8_0 blocks (rows of 32) and F32 norms, and a 32-token vocabulary."""
    import gguf
    import torch

    from gguf_files import add_tiny_vocabulary
    from llama_mini import ModelArgs, Transformer
    from llama_mini.formats.gguf import export_gguf

    folder.mkdir()
    vocabulary = gguf.GGUFWriter(str(folder / "vocab.gguf"), "llama")
    add_tiny_vocabulary(vocabulary, 32)
    for write in (vocabulary.write_header_to_file, vocabulary.write_kv_data_to_file, vocabulary.close):
        write()
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=32, multiple_of=32, max_seq_len=32))
    export_gguf(model, folder / "model.gguf", folder / "vocab.gguf", "q8_0")
    (folder / "vocab.gguf").unlink()


# --- Strategies: each draws (folder name, a function that damages a copy of that folder) ---------


def json_values():
    """Any JSON value, leaning to the numbers and near-misses a config field might hold."""
    from hypothesis import strategies as st

    sizes = st.sampled_from([0, 1, 2, 16, 32, 64, -1, -16, 10_000_000, 2**31, 2**63, 10**30])
    scalars = st.one_of(sizes, st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6),
                        st.sampled_from(["16", "1e-5", "llama", "llama3", "yarn", "default"]))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                        max_leaves=5)


def field_changes(fields):
    """Some of fields set to fuzzed values, some removed."""
    from hypothesis import strategies as st

    return st.tuples(st.dictionaries(st.sampled_from(fields), json_values(), max_size=4),
                     st.lists(st.sampled_from(fields), max_size=2))


def edit_config(file: Path, sets: dict, removes: list, inside=None) -> None:
    config = json.loads(file.read_text())
    target = config[inside] if inside else config
    target.update(sets)
    for name in removes:
        target.pop(name, None)
    file.write_text(json.dumps(config))


def params_json():
    from hypothesis import strategies as st

    fields = ["dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "ffn_dim_multiplier",
              "norm_eps", "rope_theta", "use_scaled_rope", "unknown_field"]
    whole_file = st.one_of(json_values(), st.binary(max_size=40)).map(
        lambda v: lambda d: (d / "params.json").write_bytes(v if isinstance(v, bytes) else json.dumps(v).encode()))
    edits = field_changes(fields).map(lambda c: lambda d: edit_config(d / "params.json", *c))
    return st.tuples(st.just("meta"), st.one_of(edits, whole_file))


def hf_config():
    from hypothesis import strategies as st

    from llama_mini.formats.hf import CONFIG_TYPES

    fields = [*CONFIG_TYPES, "model_type", "architectures"]
    edits = field_changes(fields).map(lambda c: lambda d: edit_config(d / "config.json", *c))
    rope = st.fixed_dictionaries({}, optional={"rope_type": json_values(), "type": json_values(), "rope_theta": json_values(),
                                               "factor": json_values()})
    rope_edits = st.tuples(st.sampled_from(["rope_scaling", "rope_parameters"]), rope).map(
        lambda c: lambda d: edit_config(d / "config.json", {c[0]: c[1]}, []))
    return st.tuples(st.sampled_from(["hf", "hf-sharded"]), st.one_of(edits, rope_edits))


def native_config():
    from hypothesis import strategies as st

    fields = ["dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "ffn_dim_multiplier", "hidden_dim",
              "norm_eps", "rope_theta", "max_seq_len", "norm", "norm_p", "tie_embeddings", "unknown_field"]
    edits = field_changes(fields).map(lambda c: lambda d: edit_config(d / "config.json", *c, inside="llama_mini"))
    replaced = json_values().map(lambda v: lambda d: (d / "config.json").write_text(json.dumps({"llama_mini": v})))
    return st.tuples(st.just("native"), st.one_of(edits, replaced))


def shard_index():
    from hypothesis import strategies as st

    names = st.one_of(st.sampled_from(["model-00001-of-00004.safetensors", "../x.safetensors", "/etc/passwd", "", ".", "..",
                                       "sub/../model-00001-of-00004.safetensors", "missing.safetensors", "config.json"]),
                      json_values())
    weight_maps = st.one_of(st.dictionaries(st.sampled_from(["model.embed_tokens.weight", "model.norm.weight", "x"]), names,
                                            max_size=3), json_values())

    def rewrite(d, weight_map, keep_real):
        index = json.loads((d / "model.safetensors.index.json").read_text())
        index["weight_map"] = {**index["weight_map"], **weight_map} if keep_real and isinstance(weight_map, dict) else weight_map
        (d / "model.safetensors.index.json").write_text(json.dumps(index))

    return st.tuples(st.just("hf-sharded"), st.tuples(weight_maps, st.booleans()).map(lambda c: lambda d: rewrite(d, *c)))


def safetensors_header():
    """A mutation of model.safetensors' header: its length field, or one tensor's entry."""
    from hypothesis import strategies as st

    def read(file):
        data = file.read_bytes()
        n = struct.unpack("<Q", data[:8])[0]
        return json.loads(data[8 : 8 + n]), data[8 + n :]

    def write(file, header, body, length=None):
        raw = json.dumps(header).encode()
        file.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + body)

    def set_length(d, length):
        header, body = read(d / "model.safetensors")
        write(d / "model.safetensors", header, body, length)

    def change_entry(d, key, field, value, body_cut):
        header, body = read(d / "model.safetensors")
        name = sorted(k for k in header if k != "__metadata__")[key % (len(header) - 1)]
        header[name][field] = value
        write(d / "model.safetensors", header, body[: len(body) - body_cut])

    lengths = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 7, 2**31, 2**63, 100_000_000]))
    # I32 and U32 have F32's size, so the header stays consistent and only the dtype is wrong.
    dtypes = st.sampled_from(["F32", "I32", "U32", "I32", "F16", "BF16", "F64", "I64", "U8", "BOOL", "F8_E4M3", "Q4", ""])
    shapes = st.lists(st.one_of(st.integers(-3, 40), st.sampled_from([2**31, 2**62, 10**12])), max_size=3)
    offsets = st.lists(st.one_of(st.integers(-4, 5000), st.sampled_from([2**62, 2**64 - 1])), max_size=3)
    entry = st.tuples(st.integers(0, 100), st.one_of(st.tuples(st.just("dtype"), dtypes), st.tuples(st.just("shape"), shapes),
                                                     st.tuples(st.just("data_offsets"), offsets)), st.sampled_from([0, 0, 4, 100]))
    changes = st.one_of(lengths.map(lambda n: lambda d: set_length(d, n)),
                        entry.map(lambda e: lambda d: change_entry(d, e[0], *e[1], e[2])))
    return st.tuples(st.sampled_from(["native", "hf"]), changes)


def llama2c_header():
    """One field of a llama2.c .bin header changed (v0: the 7 sizes; v1/v2 also the version, the
    shared flag and the group size), or bytes cut from or added to the end of the file."""
    from hypothesis import strategies as st

    def set_int(d, offset, value):
        data = bytearray((d / "model.bin").read_bytes())
        data[offset : offset + 4] = struct.pack("<i", value)
        (d / "model.bin").write_bytes(bytes(data))

    def set_byte(d, offset, value):
        data = bytearray((d / "model.bin").read_bytes())
        data[offset] = value
        (d / "model.bin").write_bytes(bytes(data))

    def resize(d, delta):
        data = (d / "model.bin").read_bytes()
        (d / "model.bin").write_bytes(data[:delta] if delta < 0 else data + bytes(delta))

    int32 = st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([0, 1, 2, 4, 8, 16, 32, -32, 10_000_000, 2**31 - 1]))
    v0 = st.tuples(st.integers(0, 6), int32).map(lambda c: lambda d: set_int(d, 4 * c[0], c[1]))
    versioned = st.one_of(st.tuples(st.sampled_from([4, *range(8, 36, 4), 37]), int32).map(lambda c: lambda d: set_int(d, *c)),
                          st.integers(0, 255).map(lambda b: lambda d: set_byte(d, 36, b)))
    sizes = st.sampled_from([-1, -4, -100, 1, 4, 1000]).map(lambda n: lambda d: resize(d, n))
    return st.one_of(st.tuples(st.just("llama2c-v0"), st.one_of(v0, sizes)),
                     st.tuples(st.sampled_from(["llama2c-v1", "llama2c-v2"]), st.one_of(versioned, sizes)))


def gguf_slots(file: Path) -> list:
    """(offset, size) of every integer that shapes a GGUF file, found by gguf's own reader: the
    header's version and counts; each metadata entry's key length, value type, string length,
    array item type and count (and the first strings' lengths), or its value; each tensor's name
    length, dimension count, dims, type and offset."""
    import gguf

    reader = gguf.GGUFReader(file)
    slots = [(4, 4), (8, 8), (16, 8)]
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        offset = field.offset
        for part in field.parts[:8]:  # key length, key, type, then the value's parts
            if part.dtype != np.uint8:  # not a string's bytes
                slots.append((offset, part.nbytes))
            offset += part.nbytes
    for tensor in reader.tensors:
        offset = tensor.field.offset
        for part in tensor.field.parts:
            if part.dtype != np.uint8:
                slots += [(offset + i * part.itemsize, part.itemsize) for i in range(part.size)]
            offset += part.nbytes
    return slots


def gguf_file():
    """An integer of the file's structure overwritten (see gguf_slots), a metadata key removed or
    given another value and type, or bytes cut from or added to the end."""
    import gguf as gguf_package
    from hypothesis import strategies as st

    base = Path(tempfile.mkdtemp(prefix="fuzz-gguf-"))
    write_base_gguf(base / "gguf")
    slots = gguf_slots(base / "gguf" / "model.gguf")
    fields = GGUFFields(base / "gguf" / "model.gguf")
    V = gguf_package.GGUFValueType

    def overwrite(d, slot, value):
        offset, size = slots[slot % len(slots)]
        data = bytearray((d / "model.gguf").read_bytes())
        data[offset : offset + size] = (value % 2 ** (8 * size)).to_bytes(size, "little")
        (d / "model.gguf").write_bytes(bytes(data))

    def resize(d, delta):
        data = (d / "model.gguf").read_bytes()
        (d / "model.gguf").write_bytes(data[:delta] if delta < 0 else data + bytes(delta))

    numbers = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from(
        [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 30, 31, 32, 33, 64, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63, 2**64 - 1]))
    values = st.one_of(st.tuples(st.integers(0, 2**31 - 1), st.sampled_from([V.UINT32, V.INT32, V.UINT64])),
                       st.tuples(st.integers(-(2**31), -1), st.just(V.INT32)), st.tuples(st.integers(2**31, 2**64 - 1), st.just(V.UINT64)),
                       st.tuples(st.floats(width=32), st.just(V.FLOAT32)), st.tuples(st.booleans(), st.just(V.BOOL)),
                       st.tuples(st.sampled_from(["llama", "gpt2", "llama-bpe", "", "linear", "yarn", "none"]), st.just(V.STRING)),
                       st.tuples(st.lists(st.integers(0, 40), min_size=1, max_size=40), st.just(V.ARRAY)))
    structure = st.tuples(st.integers(0, 10**6), numbers).map(lambda c: lambda d: overwrite(d, *c))
    metadata = st.tuples(st.sampled_from(sorted(fields.keys)), st.one_of(st.none(), values)).map(
        lambda c: lambda d: fields.rewrite(d / "model.gguf", *c))
    sizes = st.sampled_from([-1, -7, -100, -1000, 1, 31, 4096]).map(lambda n: lambda d: resize(d, n))
    return st.tuples(st.just("gguf"), st.one_of(structure, structure, metadata, sizes))


class GGUFFields:
    """A GGUF file rewritten by gguf's writer with one metadata key removed or changed."""

    def __init__(self, file: Path):
        import gguf

        reader = gguf.GGUFReader(file)
        self.keys = [key for key in reader.fields if not key.startswith("GGUF.") and key != "general.architecture"]
        self.fields = {key: (field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
                       for key, field in reader.fields.items() if key in self.keys}
        self.tensors = [(t.name, np.array(t.data), t.tensor_type) for t in reader.tensors]

    def rewrite(self, file: Path, key: str, value) -> None:
        import gguf

        fields = dict(self.fields)
        if value is None:
            del fields[key]
        else:
            item = gguf.GGUFValueType.UINT32 if value[1] == gguf.GGUFValueType.ARRAY else None
            fields[key] = (*value, item)
        writer = gguf.GGUFWriter(str(file), "llama")
        for name, (content, kind, item) in fields.items():
            writer.add_key_value(name, content, kind, item)
        for name, data, kind in self.tensors:
            writer.add_tensor(name, data, raw_dtype=None if kind == gguf.GGMLQuantizationType.F32 else kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


STRATEGIES = {"safetensors_header": safetensors_header, "params_json": params_json, "hf_config": hf_config,
              "native_config": native_config, "shard_index": shard_index, "llama2c_header": llama2c_header, "gguf": gguf_file}

if __name__ == "__main__":
    run_child(sys.argv[1])
