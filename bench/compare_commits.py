"""Two checkouts of llama_mini side by side: the same models' logits bit for bit, and their speed.

For a change that should leave the numbers and the speed as they are (a refactor, a new check
at load time): each checkout, in a child process of its own, builds the same seeded models of
llama2.c's 15M and 110M shapes in fp32, bf16, int8 and int4, puts them on the CPU kernels as
generate.py does, reads a 128-token prompt (three times, the fastest kept) and decodes 32
tokens greedily. The logits of the two checkouts are compared with torch.equal; the time to
read the prompt and the time per decoding step are medians over rounds, the checkouts taking
turns round after round so that the load of other processes falls on both alike.

    python bench/compare_commits.py OLD_CHECKOUT NEW_CHECKOUT [--rounds 5] [--sizes 15M 110M]
    python bench/compare_commits.py OLD_CHECKOUT NEW_CHECKOUT --gguf FILE ...   # files, loaded as generate.py loads them

With --gguf, each file takes the place of the seeded models: one variant, the file with
generate.py's default flags (its own precision, the CPU kernels where they run).

(a checkout of another commit: git worktree add /tmp/old COMMIT)
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = {
    "15M": dict(dim=288, n_layers=6, n_heads=6, vocab_size=32000, multiple_of=32, max_seq_len=256),
    "110M": dict(dim=768, n_layers=12, n_heads=12, vocab_size=32000, hidden_dim=2048, max_seq_len=256),
}

# Runs in the checkout given as argv[1]: times and logits of every variant, as JSON and a .pt file.
CHILD = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from llama_mini import ModelArgs, Transformer, quantize
from llama_mini.kernels import use_fused_rmsnorm
try:
    from llama_mini.kernels import use_cpu_kernels
except ImportError:  # before 0.2.0
    from llama_mini.kernels import use_matvec as use_cpu_kernels
from llama_mini.kernels import on_kernels

shape, out = json.loads(sys.argv[2]), sys.argv[3]


def seeded(variant):
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**shape)).eval()
    if variant in ("int8", "int4"):
        quantize(model, variant)
    return use_cpu_kernels(use_fused_rmsnorm(model.to(torch.bfloat16 if variant != "fp32" else torch.float32)))


def as_generate_loads(variant):
    import argparse
    from llama_mini.inference.loading import add_model_arguments, load_model, open_checkpoint
    p = argparse.ArgumentParser()
    add_model_arguments(p)
    args = p.parse_args(["--ckpt", shape["gguf"], "--device", "cpu"])
    return load_model(args, *open_checkpoint(args))


variants, make = (["as loaded"], as_generate_loads) if "gguf" in shape else (["fp32", "bf16", "int8", "int4"], seeded)
results, logits = {}, {}
for variant in variants:
    model = make(variant)
    prompt = torch.randint(0, model.args.vocab_size, (1, 128), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        prefills = []
        for _ in range(3):  # the prompt read three times, the fastest kept
            model.setup_cache(1, 160)
            start = time.perf_counter()
            first = model(prompt, 0, last_only=True)[:, -1]
            prefills.append(time.perf_counter() - start)
        prefill = min(prefills)
        steps, token, seen = [], first.argmax(-1, keepdim=True), [first]
        for pos in range(128, 160):
            start = time.perf_counter()
            step = model(token, pos, last_only=True)[:, -1]
            steps.append(time.perf_counter() - start)
            seen.append(step)
            token = step.argmax(-1, keepdim=True)
        model.drop_cache()
    results[variant] = {"prefill_s": prefill, "step_s": statistics.median(steps[2:]), "on_kernels": on_kernels(model)}
    logits[variant] = torch.cat(seen).float()
torch.save(logits, out + ".pt")
print(json.dumps(results))
"""


def run_child(checkout: Path, shape: dict, out: Path) -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD, str(checkout), json.dumps(shape), str(out)], capture_output=True,
                            text=True, cwd=checkout)
    if result.returncode:
        sys.exit(f"{checkout}: {result.stderr.strip().splitlines()[-1]}")
    return json.loads(result.stdout.splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sizes", nargs="+", choices=SHAPES, default=list(SHAPES))
    p.add_argument("--gguf", nargs="+", type=Path, help="GGUF files in place of the seeded models")
    args = p.parse_args()
    import torch

    if stray := next((path for path in (args.old, args.new) if not (path / "llama_mini").is_dir()), None):
        sys.exit(f"error: {stray} is not a checkout of llama_mini (no llama_mini/ folder in it)")
    if missing := next((path for path in args.gguf or [] if not path.is_file()), None):
        sys.exit(f"error: {missing} is not a file")
    specs = {path.name: {"gguf": str(path.resolve())} for path in args.gguf} if args.gguf else {size: SHAPES[size] for size in args.sizes}
    with tempfile.TemporaryDirectory() as tmp:
        for size, spec in specs.items():
            runs = {"old": [], "new": []}
            for r in range(args.rounds):
                for side in ("old", "new"):
                    runs[side].append(run_child(getattr(args, side), spec, Path(tmp) / f"{side}-{size}-{r}"))
            print(f"\n{size}: medians of {args.rounds} rounds, the checkouts taking turns")
            print("| variant | on kernels (old, new) | same logits, bit for bit | prompt tok/s old | new | new/old "
                  "| decoding tok/s old | new | new/old |")
            print("|---|---|---|---|---|---|---|---|---|")
            for variant in runs["old"][0]:
                old, new = ({key: statistics.median(run[variant][key] for run in runs[side]) for key in ("prefill_s", "step_s")}
                            for side in ("old", "new"))
                logits = {side: [torch.load(Path(tmp) / f"{side}-{size}-{r}.pt")[variant] for r in range(args.rounds)]
                          for side in ("old", "new")}
                differing = [r for r in range(args.rounds) if not torch.equal(logits["old"][r], logits["new"][r])]
                same = "yes" if not differing else f"NO in rounds {differing}: " + ", ".join(
                    f"{side} {'alike' if all(torch.equal(x, logits[side][0]) for x in logits[side]) else 'unlike'} across rounds"
                    for side in ("old", "new"))
                kernels = (runs["old"][0][variant]["on_kernels"], runs["new"][0][variant]["on_kernels"])
                print(f"| {variant} | {kernels} | {same} | {128 / old['prefill_s']:.0f} | "
                      f"{128 / new['prefill_s']:.0f} | {old['prefill_s'] / new['prefill_s']:.3f} | {1 / old['step_s']:.1f} | "
                      f"{1 / new['step_s']:.1f} | {old['step_s'] / new['step_s']:.3f} |")


if __name__ == "__main__":
    main()
