"""Speculative decoding's speed: tokens/s with a draft against plain decoding of the same model, greedy.

Two kinds of pair:
- trained ones (--pair TARGET DRAFT, checkpoints trained here on the same tokenizer), read with
  prompts from a text file (--prompts: paragraphs of it), where the acceptance rate means
  something;
- random weights of a Llama shape (--sizes 110M 1B) with a draft cut from the target (its first
  --draft-layers blocks and its head): near-zero acceptance, so the cost side alone (what a
  round costs beside a plain step).
Prompt lookup (--lookup: the draft "ngram") runs on a copying prompt: a paragraph, then its
first words again, so that an answer that copies is the likely one.

Each configuration (plain, then the draft at each --lookahead) runs once per round, in the same
order, round after round, so the load of other processes falls on all alike; tokens/s are
medians over rounds, of generate calls that read the prompt and decode --tokens tokens. Every
run's tokens are checked against plain decoding's: greedy output must be identical.

    python bench/speculative_speed.py --pair checkpoints/spec/stories-target checkpoints/spec/stories-draft --lookup
    python bench/speculative_speed.py --pair checkpoints/spec/shakespeare-target checkpoints/spec/shakespeare-draft --prompts input.txt
    python bench/speculative_speed.py --sizes 110M 1B --variants fp32 int4
    python bench/speculative_speed.py --quick        # a tiny random pair, 1 round: checks that it all runs
"""

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
from llama_mini import ModelArgs, Transformer, generate, load_checkpoint, open_tokenizer  # noqa: E402
from llama_mini.formats.checkpoint import checkpoint_tokenizer  # noqa: E402
from llama_mini.generation import NGRAM, generate_stream  # noqa: E402
from llama_mini.run import corpus  # noqa: E402
from llama_mini.kernels import build, on_kernels, use_cpu_kernels, use_fused_rmsnorm  # noqa: E402
from llama_mini.quant import quantize  # noqa: E402

SIZES = {
    "tiny": dict(dim=64, n_layers=4, n_heads=4, multiple_of=32),
    "110M": dict(dim=768, n_layers=12, n_heads=12),
    "1B": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, hidden_dim=5632),
}
VARIANTS = ("fp32", "bf16", "int8", "int4")


def as_variant(model: Transformer, variant: str) -> Transformer:
    """model (a copy where it changes) in the variant's type, on the CPU kernels as generate.py runs it."""
    model = copy.deepcopy(model)
    if variant in ("int8", "int4"):
        quantize(model, variant)
    if variant != "fp32":
        model.to(torch.bfloat16)
    return use_cpu_kernels(use_fused_rmsnorm(model))


def cut_draft(target: Transformer, layers: int) -> Transformer:
    """The target's first `layers` blocks, its final norm and its head: a draft that costs
    layers / n_layers of a step and shares the vocabulary."""
    args = ModelArgs(**{**vars(target.args), "n_layers": layers})
    draft = Transformer(args).eval()
    draft.load_state_dict({k: v for k, v in target.state_dict().items()
                           if not k.startswith("layers.") or int(k.split(".")[1]) < layers})
    return draft


def random_pair(size: str, draft_layers: int):
    torch.manual_seed(0)
    target = Transformer(ModelArgs(**SIZES[size], vocab_size=32000, max_seq_len=2048)).eval()
    return target, cut_draft(target, draft_layers)


def paragraphs(source: str) -> list:
    """The paragraphs of the text file source, or of stories the built-in corpus writes with a
    seed of their own ("stories": text like the training data, not the same)."""
    text = "\n\n".join(corpus.stories(50_000, seed=123)) if source == "stories" else Path(source).read_text(encoding="utf-8")
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def text_prompts(source: str, tokenizer, count: int, words: int):
    """count prompts from paragraphs of source: their first `words` words, BOS first."""
    paragraphs_ = [p for p in paragraphs(source) if len(p.split()) >= 2 * words]
    step = max(1, len(paragraphs_) // count)
    return [tokenizer.encode(" ".join(p.split()[:words]), bos=True) for p in paragraphs_[::step][:count]]


def copying_prompts(source: str, tokenizer, count: int, words: int):
    """count prompts that ask for a copy: a paragraph's first `words` words, a blank line, then
    its first few words again."""
    paragraphs_ = [p for p in paragraphs(source) if len(p.split()) >= words]
    step = max(1, len(paragraphs_) // count)
    prompts = []
    for p in paragraphs_[::step][:count]:
        head = p.split()[:words]
        prompts.append(tokenizer.encode(" ".join(head) + "\n\n" + " ".join(head[:4]), bos=True))
    return prompts


def random_prompts(count: int, length: int, vocab_size: int):
    g = torch.Generator().manual_seed(1)
    return [[1] + torch.randint(3, vocab_size, (length - 1,), generator=g).tolist() for _ in range(count)]


def measure(target, draft, prompts, lookaheads, tokens: int, rounds: int) -> dict:
    """{configuration: (tokens/s median, accepted share or None)}; plain first. Each
    configuration's greedy tokens are checked against plain decoding's."""
    configs = [("plain", None, None)] + [(f"K={k}", draft, k) for k in lookaheads]
    times = {name: [] for name, _, _ in configs}
    expected, accepted = None, {}
    for _ in range(rounds):
        for name, drafter, k in configs:
            tally = {}
            start = time.perf_counter()
            out = [generate_with_tally(target, p, tokens, drafter, k, tally) for p in prompts]
            times[name].append(time.perf_counter() - start)
            if expected is None:
                expected = out
            elif out != expected:
                raise SystemExit(f"{name}: greedy tokens differ from plain decoding's")
            if drafter is not None:
                accepted[name] = tally.get("accepted", 0) / max(tally.get("drafted", 0), 1)
    n = sum(len(row) for row in expected)
    return {name: (n / statistics.median(t), accepted.get(name)) for name, t in times.items()}


def generate_with_tally(target, prompt, tokens, draft, lookahead, tally):
    if draft is None:
        return generate(target, [prompt], tokens, temperature=0)[0]
    return [step[0] for step in generate_stream(target, [prompt], tokens, 0.0, 1.0, None, None, 0, draft, lookahead, tally)]


def llama_cpp_rows(pair, tokenizer_path, prompts, lookaheads, tokens: int, rounds: int, lookup: bool) -> dict:
    """The same measurement on llama.cpp (llama-cpp-python) reading the pair exported as GGUF F32:
    plain, the draft model through llama-cpp-python's draft API at each K, or prompt lookup
    (lookup: its LlamaPromptLookupDecoding, n-grams of up to 3). Returns {configuration:
    (tokens/s, None)} and says whether each configuration's tokens are its plain decoding's."""
    import tempfile

    import llama_cpp
    import numpy as np
    from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding
    from llama_mini.formats.gguf import export_gguf

    class ModelDraft(LlamaDraftModel):
        """A draft model for llama-cpp-python's draft API: k greedy tokens of a second Llama."""

        def __init__(self, llm, k):
            self.llm, self.k = llm, k

        def __call__(self, input_ids, **kwargs):
            out = []
            for token in self.llm.generate(input_ids.tolist(), top_k=1, temp=0.0):  # its cache's prefix is reused
                out.append(token)
                if len(out) == self.k:
                    break
            return np.array(out, dtype=np.intc)

    folder = Path(tempfile.mkdtemp())
    paths = [folder / "target.gguf", folder / "draft.gguf"]
    for source, path in zip(pair, paths):
        export_gguf(load_checkpoint(source, dtype=torch.float32), path, tokenizer_path, "f32")
    threads = torch.get_num_threads()
    n_ctx = load_checkpoint(pair[0]).args.max_seq_len

    def llm(path, **kw):
        return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False, **kw)

    configs = [("plain", llm(paths[0]))]
    for k in lookaheads:
        draft = LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=k) if lookup else ModelDraft(llm(paths[1]), k)
        configs.append((f"K={k}", llm(paths[0], draft_model=draft)))

    def run(model, prompt):
        model.reset()
        out = []
        for token in model.generate(prompt, top_k=1, temp=0.0):
            out.append(token)
            if len(out) == tokens:
                return out

    times, outputs = {name: [] for name, _ in configs}, {}
    for _ in range(rounds):
        for name, model in configs:
            start = time.perf_counter()
            outputs[name] = [run(model, p) for p in prompts]
            times[name].append(time.perf_counter() - start)
    for name in times:
        if name != "plain":
            same = outputs[name] == outputs["plain"]
            print(f"llama.cpp {name}: {'the same tokens as' if same else 'OTHER tokens than'} its plain decoding")
    n = len(prompts) * tokens
    return {name: (n / statistics.median(t), None) for name, t in times.items()}


def report(title: str, rows: dict) -> None:
    """A markdown table: each configuration's tokens/s, its ratio to plain and its acceptance; the best K marked."""
    plain = rows["plain"][0]
    best = max((name for name in rows if name != "plain"), key=lambda name: rows[name][0], default=None)
    print(f"\n{title}\n")
    print("| configuration | tokens/s | / plain | proposals accepted |")
    print("|---|---|---|---|")
    for name, (speed, share) in rows.items():
        mark = " (best)" if name == best else ""
        print(f"| {name}{mark} | {speed:,.1f} | {speed / plain:.2f}x | {'' if share is None else f'{100 * share:.0f}%'} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", nargs=2, metavar=("TARGET", "DRAFT"), help="two checkpoints of one tokenizer")
    p.add_argument("--prompts", default="stories", help="a text file whose paragraphs start the prompts (with --pair), "
                                                       "or stories: the built-in corpus's (default)")
    p.add_argument("--sizes", nargs="*", default=[], choices=SIZES, help="random shapes, a draft cut from the target")
    p.add_argument("--draft-layers", type=int, default=2, help="blocks of the cut draft (--sizes)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--lookahead", type=int, nargs="+", default=[2, 3, 4, 5, 6, 8])
    p.add_argument("--lookup", action="store_true", help="also prompt lookup (--draft ngram) on copying prompts")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--count", type=int, default=4, help="prompts per configuration and round")
    p.add_argument("--words", type=int, default=24, help="words of text per prompt (twice as many for copying prompts)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch's and llama.cpp's CPU threads (default: torch's choice)")
    p.add_argument("--llama-cpp", action="store_true", help="also llama.cpp on the pair exported as GGUF F32 (pip install llama-cpp-python)")
    p.add_argument("--quick", action="store_true", help="the tiny random shape, 16 tokens, 1 round")
    args = p.parse_args()
    if args.quick:
        args.sizes, args.tokens, args.rounds, args.count, args.variants, args.lookahead = ["tiny"], 16, 1, 2, ["fp32"], [2, 4]
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU threads: {torch.get_num_threads()}; greedy; {args.count} prompts x {args.tokens} new tokens; "
          f"median of {args.rounds} rounds; torch {torch.__version__}; kernels built for {build.isa()} (LLAMA_MINI_ISA)")
    if args.pair:
        target, draft = (load_checkpoint(path, dtype=torch.float32) for path in args.pair)
        tokenizer = open_tokenizer(checkpoint_tokenizer(args.pair[0]))
        prompts = text_prompts(args.prompts, tokenizer, args.count, args.words)
        print(f"target {args.pair[0]}: {target.args.n_parameters / 1e6:.1f}M parameters; draft {args.pair[1]}: "
              f"{draft.args.n_parameters / 1e6:.1f}M")
        for variant in args.variants:
            t, d = as_variant(target, variant), as_variant(draft, variant)
            assert on_kernels(t) and on_kernels(d), "the CPU kernels do not run these models"
            report(f"{variant}, trained pair", measure(t, d, prompts, args.lookahead, args.tokens, args.rounds))
        if args.lookup:
            copying = copying_prompts(args.prompts, tokenizer, args.count, 2 * args.words)
            t = as_variant(target, "fp32")
            report("fp32, prompt lookup on copying prompts", measure(t, NGRAM, copying, args.lookahead, args.tokens, args.rounds))
        if args.llama_cpp:
            tokenizer_path = checkpoint_tokenizer(args.pair[0])
            report("llama.cpp, GGUF F32, the trained pair (its draft API)",
                   llama_cpp_rows(args.pair, tokenizer_path, prompts, args.lookahead, args.tokens, args.rounds, lookup=False))
            if args.lookup:
                report("llama.cpp, GGUF F32, prompt lookup on copying prompts",
                       llama_cpp_rows(args.pair, tokenizer_path, copying, args.lookahead, args.tokens, args.rounds, lookup=True))
    for size in args.sizes:
        base, cut = random_pair(size, args.draft_layers)
        prompts = random_prompts(args.count, 16, base.args.vocab_size)
        for variant in args.variants:
            t, d = as_variant(base, variant), as_variant(cut, variant)
            report(f"{size}, {variant}, random weights, draft = its first {args.draft_layers} blocks",
                   measure(t, d, prompts, args.lookahead, args.tokens, args.rounds))
            del t, d


if __name__ == "__main__":
    main()
