"""A GGUF file run by llama_mini and by llama.cpp side by side: peak memory, load time, prompt
and decoding speed, each in its own process, on the very same file.

llama_mini runs the file as generate.py does with default flags (inference.loading.load_model:
the file's own precision, the CPU kernels where they run); llama.cpp through llama-cpp-python
(Llama(model_path), its own threads set to the same count). Each process loads the file, then runs
rounds: a prompt of random tokens read from an empty cache, then greedy decoding. Peak memory is
the process's VmHWM after its first round (a load and one generation, as generate.py's), less
the same process's before loading (Python, torch, the modules that read the file and the CPU
kernels, or llama.cpp's library), and shown again less the KV cache each holds (llama_mini's for
the positions run, llama.cpp's float16 for its context).

Speed on a shared machine moves by 10-30% from minute to minute, so the two programs take turns
a round at a time, both loaded, and each round of llama_mini is compared with llama.cpp's round
beside it: the ratio shown is the median of those, with their range and the count of rounds in
which llama_mini was at least as fast.

A decoding step reads every weight once, so beside each decoding speed is the rate at which it
streams the file's tensors (all but the token embedding, of which a step looks up one row): one
type streamed slower than another by the same program is bound by its tiles' steps, not by memory.

--make writes the files first, as a user's would be made: a model of random weights at a
named shape (Llama-3-8B's among them), written as an F16 GGUF a tensor at a time with Meta's
Llama-2 vocabulary (Llama-3's at 8B), then quantized by llama.cpp's own quantizer to each type
(Q4_K_M: Q4_K with Q6_K here and there, as llama-quantize makes it).

    python bench/gguf_speed.py --make /tmp/gguf --shape 1B --types Q8_0 Q4_0 Q4_K_M Q5_K_M Q6_K
    python bench/gguf_speed.py /tmp/gguf/1B-Q4_K_M.gguf /tmp/gguf/1B-Q8_0.gguf --prompt 256 --new 64
    LLAMA_MINI_ISA=avx2 python bench/gguf_speed.py ...     # llama_mini's AVX2 kernels, as llama.cpp's build
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from gguf import GGUFReader

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]
from tqdm import tqdm  # noqa: E402

from fixtures import LLAMA2_TOKENIZER, LLAMA3_TOKENIZER  # noqa: E402
from generate_speed import SIZES  # noqa: E402
from gguf_parity import quantize_with_llama_cpp  # noqa: E402
from llama_mini.tokenizers import open_tokenizer  # noqa: E402

# The shapes of generate_speed.py, and Llama-3-8B's.
SHAPES = {**SIZES, "8B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336, rope_theta=500000.0)}


def vm(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def prompt_tokens(n: int, vocab_size: int) -> list:
    return torch.randint(3, vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()


def run_llama_mini(path: str, prompt_len: int, new: int, threads: int):
    """Loads the file as generate.py does; returns the load's figures and a round: a prompt, then decoding."""
    from types import SimpleNamespace

    from llama_mini.formats.checkpoint import detect_format
    from llama_mini.generation import prefill
    from llama_mini.inference.loading import load_model
    from llama_mini.tokenizers import open_tokenizer

    import llama_mini.formats.gguf  # noqa: F401  (the modules' one-time memory, as llama.cpp's library is before its "before")
    from llama_mini.kernels.fused_rmsnorm import cpu_kernel
    from llama_mini.kernels.operators import operators
    from llama_mini.support.memory import kv_cache_bytes

    torch.set_num_threads(threads)
    operators(), cpu_kernel()  # the CPU kernels' libraries, loaded and checked
    before = vm("VmRSS")
    start = time.perf_counter()
    flags = SimpleNamespace(device="cpu", dtype=None, quantize=None, kernels="auto", compile=False)
    model = load_model(flags, Path(path), detect_format(Path(path)), open_tokenizer(path))
    load_s = time.perf_counter() - start
    tokens = torch.tensor([prompt_tokens(prompt_len, model.args.vocab_size)])

    @torch.inference_mode()
    def one_round() -> dict:
        model.setup_cache(1, prompt_len + new)
        t = time.perf_counter()
        token = prefill(model, tokens)[0].argmax()
        prompt_s = time.perf_counter() - t
        t = time.perf_counter()
        for position in range(prompt_len, prompt_len + new):
            token = model(token.view(1, 1), position)[0, -1].argmax()
        return {"prompt_s": prompt_s, "decode_s": time.perf_counter() - t}

    return {"load_s": load_s, "before": before, "kv": kv_cache_bytes(model.args, 1, prompt_len + new, model.kv_dtype())}, one_round


def run_llama_cpp(path: str, prompt_len: int, new: int, threads: int):
    """Loads the file with llama.cpp's own threads set to the same count; returns as run_llama_mini."""
    import llama_cpp
    import numpy as np

    before = vm("VmRSS")
    start = time.perf_counter()
    context = prompt_len + new + 8  # n_batch: llama-cpp-python keeps the scores of one batch's positions
    llm = llama_cpp.Llama(model_path=path, n_ctx=context, n_batch=max(512, context), n_ubatch=512, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - start
    tokens = prompt_tokens(prompt_len, llm.n_vocab())

    def one_round() -> dict:
        llm.reset()
        t = time.perf_counter()
        llm.eval(tokens)
        prompt_s = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(new):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        return {"prompt_s": prompt_s, "decode_s": time.perf_counter() - t}

    field = {key: int(llm.metadata[f"llama.{key}"]) for key in ("block_count", "embedding_length", "attention.head_count",
                                                                 "attention.head_count_kv")}
    kv = 2 * llm.n_ctx() * field["block_count"] * field["attention.head_count_kv"] * field["embedding_length"] \
        // field["attention.head_count"] * 2  # keys and values, float16 (llama.cpp's default)
    return {"load_s": load_s, "before": before, "kv": kv}, one_round


RUNNERS = {"llama_mini": run_llama_mini, "llama.cpp": run_llama_cpp}


def serve(runner: str, path: str, prompt_len: int, new: int, threads: int) -> None:
    """The child's side: load, say so, then run a round each time the parent asks, with the peak memory so far."""
    loaded, one_round = RUNNERS[runner](path, prompt_len, new, threads)
    print(json.dumps(loaded), flush=True)
    for _ in sys.stdin:
        print(json.dumps({**one_round(), "peak": vm("VmHWM") - loaded["before"]}), flush=True)


class Child:
    """One runner in its own process, holding the loaded file between rounds, so that the two
    programs' rounds can take turns a few seconds apart and meet the same machine."""

    def __init__(self, runner: str, path: Path, args):
        self.name = f"{runner} on {path}"
        self.errors = tempfile.TemporaryFile("w+")
        command = [sys.executable, __file__, "--child", runner, str(path), "--prompt", str(args.prompt), "--new",
                   str(args.new), "--threads", str(args.threads)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors,
                                        text=True, cwd=ROOT)
        self.loaded = self.answer()

    def answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.errors.seek(0)
            last = (self.errors.read().strip().splitlines() or ["no message"])[-1]
            sys.exit(f"{self.name} failed: {last}")
        return json.loads(line)

    def one_round(self) -> dict:
        self.process.stdin.write("round\n")
        self.process.stdin.flush()
        return self.answer()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def measure(path: Path, args) -> tuple:
    """--repeats fresh pairs of processes, each loading the file (who loads first alternates), then
    --rounds rounds each, taking turns (who goes first alternates). Returns each runner's loads (with
    the peak memory after its first round: a load and one generation, as generate.py's) and the
    rounds, paired."""
    loads, rounds = {runner: [] for runner in RUNNERS}, []
    for repeat in range(args.repeats):
        with open(path, "rb") as f:  # in the page cache, so that neither load is the one that reads the disk
            while f.read(1 << 24):
                pass
        order = list(RUNNERS)[::(-1) ** repeat]
        children = {runner: Child(runner, path, args) for runner in order}
        for turn in range(args.rounds):
            pair = {runner: children[runner].one_round() for runner in order[::(-1) ** turn]}
            rounds.append({runner: pair[runner] for runner in RUNNERS})
        for runner, child in children.items():
            loads[runner].append({**child.loaded, "peak": rounds[-args.rounds][runner]["peak"]})
            child.close()
    return loads, rounds


def streamed_bytes(path: Path) -> int:
    """The bytes of the file's tensors a decoding step reads: all but the token embedding, of
    which it looks up one row, where the file has its own output head."""
    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    return sum(sizes.values()) - (sizes.get("token_embd.weight", 0) if "output.weight" in sizes else 0)


def paired(rounds: list, key: str) -> str:
    """llama_mini's speed over llama.cpp's in the same turn: the median, the range, and how often it was at least as fast."""
    ratios = sorted(r["llama.cpp"][key] / r["llama_mini"][key] for r in rounds)
    return (f"**{statistics.median(ratios):.2f}** ({ratios[0]:.2f}-{ratios[-1]:.2f}, "
            f"{sum(ratio >= 1 for ratio in ratios)}/{len(ratios)})")


def write_random_gguf(path: Path, args, tokenizer: Path) -> None:
    """An F16 GGUF of a model of random weights (N(0, 0.02) matrices, unit norms) at args' shape,
    written a tensor at a time: an 8B model's 16 GB without ever holding it."""
    import gguf
    import numpy as np

    from llama_mini import Transformer
    from llama_mini.formats.gguf import write_hyperparameters, write_vocabulary
    from llama_mini.formats.names import to_format

    with torch.device("meta"):
        shapes = {to_format(name, "gguf"): tuple(t.shape) for name, t in Transformer(args).state_dict().items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    write_hyperparameters(writer, args, gguf.LlamaFileType.MOSTLY_F16)
    write_vocabulary(writer, tokenizer, args.vocab_size)
    dtypes = {name: np.float16 if len(shape) == 2 else np.float32 for name, shape in shapes.items()}
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * np.dtype(dtypes[name]).itemsize
        writer.add_tensor_info(name, shape, np.dtype(dtypes[name]), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    generator = np.random.default_rng(0)
    for name, shape in tqdm(shapes.items(), desc=f"writing {path.name}", unit="tensor"):
        if len(shape) == 2:
            writer.write_tensor_data((generator.standard_normal(shape, np.float32) * 0.02).astype(np.float16))
        else:
            writer.write_tensor_data(np.ones(shape, np.float32))
    writer.close()


def make(folder: Path, shape: str, types: list, threads: int) -> None:
    """A random-weight model at shape, as an F16 GGUF, then quantized by llama.cpp to each type."""
    from llama_mini import ModelArgs

    folder.mkdir(parents=True, exist_ok=True)
    f16 = folder / f"{shape}-F16.gguf"
    if not f16.exists():
        vocabulary = LLAMA3_TOKENIZER if shape == "8B" else LLAMA2_TOKENIZER
        size = dict(vocab_size=open_tokenizer(vocabulary).n_words, max_seq_len=8192 if shape == "8B" else 2048)
        write_random_gguf(f16, ModelArgs(**SHAPES[shape], **size), vocabulary)
    for kind in types:
        out = folder / f"{shape}-{kind}.gguf"
        if not out.exists():
            print(f"quantizing to {kind} with llama.cpp", file=sys.stderr)
            quantize_with_llama_cpp(f16, out, kind.removesuffix("_M"), pure=False, threads=threads)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", type=Path)
    p.add_argument("--make", type=Path, help="write random-weight files of --shape in --types to this folder first")
    p.add_argument("--shape", choices=SHAPES, default="1B")
    p.add_argument("--types", nargs="+", default=["Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K"])
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens (default: %(default)s)")
    p.add_argument("--new", type=int, default=64, help="tokens decoded (default: %(default)s)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="rounds per pair of processes (default: %(default)s)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return serve(args.child, str(args.files[0]), args.prompt, args.new, args.threads)
    files = list(args.files)
    if missing := next((path for path in files if not path.is_file()), None):
        sys.exit(f"error: {missing} is not a file; pass GGUF files, or --make a folder of them")
    if args.make:
        make(args.make, args.shape, args.types, args.threads)
        files += [args.make / f"{args.shape}-{kind}.gguf" for kind in args.types]
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, llama_mini's kernels built for "
          f"{os.environ.get('LLAMA_MINI_ISA') or 'this CPU'}, {args.threads} threads; prompt {args.prompt} tokens, "
          f"{args.new} decoded; {args.repeats} pairs of processes x {args.rounds} rounds; memory and load: the best "
          f"pair, speeds: the median round; ratios: the median of the rounds' (range, rounds at least as fast)\n")
    print("| file | MB | | peak memory (x file) | less the KV cache (x file) | load s | load and prompt s | prompt tok/s | "
          "decode tok/s (GB/s of the file) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in files:
        loads, rounds = measure(path, args)
        size, streamed, figures = path.stat().st_size, streamed_bytes(path), {}
        for runner in RUNNERS:
            peak = min(load["peak"] for load in loads[runner])
            load_s = min(load["load_s"] for load in loads[runner])
            prompt_s = statistics.median(r[runner]["prompt_s"] for r in rounds)
            decode_s = statistics.median(r[runner]["decode_s"] for r in rounds)
            rest = peak - loads[runner][0]["kv"]
            figures[runner] = (peak, rest, load_s, load_s + prompt_s)
            print(f"| {path.name} | {size / 1e6:,.0f} | {runner} | {peak / 1e6:,.0f} MB ({peak / size:.2f}x) | "
                  f"{rest / 1e6:,.0f} MB ({rest / size:.2f}x) | {load_s:.2f} | {load_s + prompt_s:.2f} | "
                  f"{args.prompt / prompt_s:,.1f} | {args.new / decode_s:.1f} ({streamed * args.new / decode_s / 1e9:.1f}) |")
        ours, theirs = figures["llama_mini"], figures["llama.cpp"]
        print(f"| | | llama_mini / llama.cpp | {ours[0] / theirs[0]:.2f} | {ours[1] / theirs[1]:.2f} | {ours[2] / theirs[2]:.2f} | "
              f"{ours[3] / theirs[3]:.2f} | {paired(rounds, 'prompt_s')} | {paired(rounds, 'decode_s')} |")

if __name__ == "__main__":
    main()
