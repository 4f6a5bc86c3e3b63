"""Loading memory: peak RSS and time to first token for a checkpoint of Llama-2-7B's shapes.

Writes a synthetic Meta-format checkpoint with Llama-2-7B's exact tensor names and shapes
(bfloat16, one consolidated.00.pth of 13.5 GB, params.json with vocab_size -1, and Meta's
tokenizer beside it when the fixture is present), then loads it in a fresh process and
generates one token. The weights are random, so only memory and time mean anything.

The file is written without ever holding the weights in memory: torch.save with
skip_data() lays out the file around uninitialised storages, and the tensors are then
filled one at a time through a shared memory map of the file itself.

Target: peak RSS <= 1.25 x the file size, so that 7B fits a 24 GiB machine. Two loads are
timed: cold (the file's pages dropped from the page cache first) and warm. With --quantize,
the checkpoint is first converted as a user converts it (python -m llama_mini.formats.convert ...
--quantize int8), and the quantized checkpoint's loads are measured against its own file.

    python bench/load_memory.py                       # writes to a temporary folder, deletes it after
    python bench/load_memory.py --quantize int8       # the same, then its int8 conversion
    python bench/load_memory.py --folder /data/7b --keep
"""

import argparse
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # tests/fixtures.py: where the shared fixtures are
from fixtures import LLAMA2_TOKENIZER  # noqa: E402
from llama_mini import ModelArgs, Transformer, generate, load_checkpoint  # noqa: E402
from llama_mini.quant import QUANTIZATIONS, parameter_count  # noqa: E402

LLAMA2_7B = {"dim": 4096, "multiple_of": 256, "n_heads": 32, "n_layers": 32, "norm_eps": 1e-05, "vocab_size": -1}


def meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def proc_status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def write_checkpoint(folder: Path) -> Path:
    """Meta's llama-2-7b layout, filled with N(0, 0.02) weights and unit norm weights."""
    folder.mkdir(parents=True, exist_ok=True)
    params = dict(LLAMA2_7B)
    if LLAMA2_TOKENIZER.is_file():
        shutil.copyfile(LLAMA2_TOKENIZER, folder / "tokenizer.model")
    else:
        params["vocab_size"] = 32000
    (folder / "params.json").write_text(json.dumps(params))
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(ModelArgs(**{**LLAMA2_7B, "vocab_size": 32000})).state_dict().items()}
    shapes["rope.freqs"] = torch.Size([64])  # present in Meta's files
    # torch.empty only reserves address space: untouched pages cost no memory, and
    # skip_data() writes the file's layout without reading them.
    state = {k: torch.empty(shape, dtype=torch.bfloat16) for k, shape in shapes.items()}
    file = folder / "consolidated.00.pth"
    with torch.serialization.skip_data():
        torch.save(state, file)
    del state
    torch.serialization.set_default_mmap_options(mmap.MAP_SHARED)  # writes go to the file
    try:
        mapped = torch.load(file, mmap=True, weights_only=True)
        generator = torch.Generator().manual_seed(0)
        for name, tensor in tqdm(mapped.items(), desc="writing weights", unit="tensor"):
            if tensor.dim() == 1:
                tensor.fill_(1.0)
            else:
                tensor.normal_(0.0, 0.02, generator=generator)
        del mapped
    finally:
        torch.serialization.set_default_mmap_options(mmap.MAP_PRIVATE)
    with open(file, "rb+") as f:
        os.fsync(f.fileno())
    return file


def child(folder: str, prompt_len: int) -> None:
    """Runs in a fresh process: load, generate one token, report memory and times as JSON."""
    start = time.perf_counter()
    model = load_checkpoint(folder)
    loaded = time.perf_counter()
    quantization = getattr(model, "quantization", None)
    rss_after_load = proc_status("VmRSS")
    prompt = [1] + list(range(100, 100 + prompt_len - 1))
    token = generate(model, [prompt], 1, temperature=0)[0]
    first = time.perf_counter()
    print(json.dumps({
        "load_s": loaded - start, "first_token_s": first - start, "rss_after_load": rss_after_load,
        "peak_rss": proc_status("VmHWM"), "token": token, "params": parameter_count(model),
        "dtype": quantization["method"] if quantization else str(model.output.weight.dtype),
    }))


def drop_from_page_cache(file: Path) -> None:
    with open(file, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def measure_loads(folder: Path, file: Path, prompt_len: int) -> None:
    """Load folder in fresh processes, cold then warm, and print peak memory against file's size."""
    size = file.stat().st_size
    print(f"{file.name}: {size / 2**30:.2f} GiB")
    for label in ("cold", "warm"):
        available = meminfo("MemAvailable")
        if available < 1.25 * size + (1 << 30):
            sys.exit(f"error: only {available / 2**30:.1f} GiB of memory is available; loading needs about {1.25 * size / 2**30:.1f} GiB")
        if label == "cold":
            drop_from_page_cache(file)
        result = subprocess.run(
            [sys.executable, __file__, "--child", str(folder), "--prompt-len", str(prompt_len)],
            capture_output=True, text=True, check=True,
        )
        r = json.loads(result.stdout.strip().splitlines()[-1])
        print(
            f"{label}: {r['params'] / 1e9:.2f}B parameters ({r['dtype']}), load {r['load_s']:.1f}s, "
            f"first token after {r['first_token_s']:.1f}s ({prompt_len}-token prompt); "
            f"RSS after load {r['rss_after_load'] / 2**30:.2f} GiB, peak RSS {r['peak_rss'] / 2**30:.2f} GiB "
            f"= {r['peak_rss'] / size:.2f} x file size (target <= 1.25)"
        )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", help="where to write the checkpoint (default: a temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--quantize", choices=QUANTIZATIONS, help="also convert the checkpoint to int8 or int4 and measure its loads")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child, args.prompt_len)

    folder = Path(args.folder) if args.folder else Path(tempfile.mkdtemp(prefix="llama2-7b-synthetic-"))
    file = folder / "consolidated.00.pth"
    try:
        if not file.is_file():
            need = 13_500_000_000
            free = shutil.disk_usage(folder).free
            if free < need * 1.1:
                sys.exit(f"error: {folder} has {free / 1e9:.1f} GB free; the checkpoint needs {need / 1e9:.1f} GB")
            start = time.perf_counter()
            write_checkpoint(folder)
            print(f"wrote {file} in {time.perf_counter() - start:.0f}s")
        measure_loads(folder, file, args.prompt_len)
        if args.quantize:
            quantized = folder / args.quantize
            if not quantized.is_dir():
                start = time.perf_counter()
                subprocess.run([sys.executable, "-m", "llama_mini.formats.convert", str(folder), str(quantized), "--to", "native",
                                "--quantize", args.quantize], check=True, cwd=Path(__file__).resolve().parents[1])
                print(f"converted to {args.quantize} in {time.perf_counter() - start:.0f}s: {quantized}")
            measure_loads(quantized, quantized / "model.safetensors", args.prompt_len)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
