"""TrainConfig: one field per train.py flag, each with its help text, from which the flags are made.

Each option is described once, as a field with its help (litgpt's way): add_arguments turns
the fields into argparse flags for train.py and the ablation, so the help text, the default
and the type cannot drift apart.
"""

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ..support.cli import KERNELS, check_context, check_number, flag, utf8_text
from ..support.device import DTYPES
from ..model import NORMS, ModelArgs
from ..trainer import LR_SCHEDULES, OPTIMIZERS, Hyperparameters
from .data import corpus_name

# --dtype's choices: auto, or one of the dtypes, but float16, which needs a gradient scaler
# that the training step does not have.
TRAIN_DTYPES = ("auto", *(name for name in DTYPES if name != "float16"))


def option(default, help: str, **extra):
    """A TrainConfig field with its flag's help text: each flag is described here, once."""
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class TrainConfig:
    """One field per train.py flag (--max-steps is max_steps). The defaults train a
    ~2M-parameter model on the built-in stories in minutes on a laptop's CPU."""

    data: Optional[str] = option(None, "a UTF-8 .txt file or a folder of them (default: the built-in stories)")
    out: Optional[str] = option(None, "run folder for checkpoints and metrics (default: checkpoints/<run-name>)")
    run_name: Optional[str] = option(None, "name of the run folder under checkpoints/ (default: the data's name)")
    init_from: Optional[str] = option(None, "fine-tune this checkpoint (any format generate.py reads), with its shape and tokenizer")
    cache_dir: str = option("tokenizer", "where trained tokenizers and tokenised data are cached")
    tokenizer: Optional[str] = option(None, "use this tokenizer.model instead of training one on the data")
    # 2048 makes every name in the built-in stories one token.
    vocab_size: Optional[int] = option(None, "vocabulary size of the tokenizer trained on the data", scratch=2048)
    val_fraction: float = option(0.1, "fraction of the tokens held out for validation")
    dim: Optional[int] = option(None, "model width", scratch=192)
    n_layers: Optional[int] = option(None, "number of Transformer blocks", scratch=4)
    n_heads: Optional[int] = option(None, "attention heads", scratch=6)
    n_kv_heads: Optional[int] = option(
        None, "key/value heads for grouped-query attention (default: n_heads, or the checkpoint's with --init-from or --resume)")
    multiple_of: Optional[int] = option(
        None, "the feed-forward (SwiGLU) width is 2/3 of 4 * dim rounded up to a multiple of this, Meta's rule; "
        "at small widths 256 makes it up to 1.5x a GPT's 4 * dim MLP, 32 about equal", scratch=256)
    norm: Optional[str] = option(None, "normalisation layer", scratch="rmsnorm", choices=NORMS)
    norm_p: Optional[float] = option(None, "fraction of each vector partial RMSNorm (prmsnorm) reads", scratch=0.0625)
    tie_embeddings: Optional[bool] = option(
        None, "share the token embedding with the output layer, as llama2.c and Llama-3.2 1B do "
        "(--no-tie-embeddings: Llama-2's own)", scratch=True)
    max_steps: int = option(600, "optimizer steps to train for")
    batch_size: int = option(16, "sequences per micro-step per process")
    seq_len: int = option(256, "tokens per training sequence (the context length)")
    grad_accum: int = option(1, "micro-steps accumulated into one optimizer step")
    lr: float = option(4e-3, "peak learning rate")
    min_lr: Optional[float] = option(None, "learning rate at the end of the cosine (default: lr / 10)")
    warmup_steps: int = option(50, "steps of linear learning-rate warmup")
    weight_decay: float = option(0.1, "weight decay (matrices only)")
    optimizer: Optional[str] = option(
        None, "adamw: Llama's; muon: Muon on the blocks' matrices and AdamW on the embedding, head and norms, as nanochat "
        "and modded-nanogpt train (the same --lr and --weight-decay)", fresh="adamw", choices=OPTIMIZERS)
    lr_schedule: Optional[str] = option(
        None, "cosine: warmup, then a cosine to --min-lr; wsd: warmup, the peak held, and a linear decay to --min-lr over "
        "the last 20%% of the steps", fresh="cosine", choices=LR_SCHEDULES)
    grad_clip: float = option(1.0, "clip the gradient norm to this (0: no clipping)")
    seed: int = option(1337, "seed for initialisation, data order and the final sample")
    resume: bool = option(False, "continue the run in --out from its latest checkpoint")
    save_every: int = option(200, "save a checkpoint every N steps")
    keep_checkpoints: int = option(2, "how many of the newest checkpoints to keep")
    eval_every: int = option(100, "evaluate on the validation split every N steps")
    eval_iters: int = option(10, "batches per evaluation")
    sample_tokens: int = option(200, "length of the sample printed at the end (0: none)")
    prompt: str = option("Once upon a time", "start of the sample printed at the end")
    device: Optional[str] = option(None, "cuda, mps or cpu (default: the first available, in that order)")
    dtype: str = option("auto", "auto: bfloat16 autocast on CUDA, float32 elsewhere", choices=TRAIN_DTYPES)
    compile: bool = option(False, "torch.compile the model, each Transformer block on its own")
    kernels: str = option("auto", "auto: on a CPU, llama_mini's fused RMSNorm, SwiGLU gate and RoPE kernels, where they "
                          "build (on a GPU with Triton, each RMSNorm compiled); off: model.py's own code", choices=KERNELS)
    flush_denormals: Optional[bool] = option(
        None, "read and write subnormal floats (below 1.2e-38) as zero on every CPU thread, as a GPU's fast paths do: "
        "x86 computes on them in microcode, and a run that meets them slows as it trains by up to 50%%, by another "
        "amount each seed; changes the run's bits", fresh=False)
    fsdp: bool = option(False, "shard the model with FSDP2 (fully_shard per block) under torchrun")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is None and (
                    "scratch" in f.metadata and not (self.resume or self.init_from)  # a run from scratch: the shape is ours
                    or "fresh" in f.metadata and not self.resume):  # the recipe: ours, unless the run is resumed
                setattr(self, f.name, f.metadata.get("scratch", f.metadata.get("fresh")))
        for name in ("data", "out", "run_name", "init_from", "cache_dir", "tokenizer", "prompt"):
            if getattr(self, name) is not None:  # a path or text every line, record and plot must hold
                utf8_text(getattr(self, name), flag(name))
        for name in ("max_steps", "batch_size", "grad_accum", "dim", "n_layers", "n_heads", "n_kv_heads",
                     "multiple_of", "vocab_size", "save_every", "eval_every", "eval_iters", "keep_checkpoints"):
            check_number(flag(name), getattr(self, name), 1)
        check_context("--seq-len", self.seq_len)
        for name in ("warmup_steps", "weight_decay", "grad_clip", "sample_tokens"):
            check_number(flag(name), getattr(self, name), 0)
        check_number("--lr", self.lr, 0, low_open=True)
        check_number("--min-lr", self.min_lr, 0, self.lr, note=" (at most --lr)")
        check_number("--val-fraction", self.val_fraction, 0, 1, low_open=True, high_open=True)
        check_number("--seed", self.seed, 0, 2**63, high_open=True)
        check_number("--norm-p", self.norm_p, 0, 1, low_open=True)
        if self.run_name is not None and (Path(self.run_name).name != self.run_name or self.run_name in ("", "..")):
            raise ValueError(f"--run-name {self.run_name!r} must be a plain folder name under checkpoints/; "
                             "to write elsewhere, pass --out DIR")
        if self.dtype not in TRAIN_DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(TRAIN_DTYPES)}, got {self.dtype!r}")
        for name, choices in (("optimizer", OPTIMIZERS), ("lr_schedule", LR_SCHEDULES)):
            if getattr(self, name) not in (*choices, None):
                raise ValueError(f"{flag(name)} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        if self.optimizer == "muon" and not hasattr(torch.optim, "Muon"):
            raise ValueError(f"--optimizer muon needs torch.optim.Muon, in torch 2.9 and later (this is torch "
                             f"{torch.__version__}); upgrade torch, or train with --optimizer adamw")
        if self.optimizer == "muon" and self.fsdp:
            raise ValueError("--optimizer muon orthogonalises whole matrices, which --fsdp shards across processes; "
                             "train Muon with DDP (torchrun without --fsdp), or --fsdp with --optimizer adamw")
        if not (self.resume or self.init_from):
            self.model_args(vocab_size=self.vocab_size)  # shape errors (dim vs heads, unknown norm) now, not later

    def model_args(self, vocab_size: int) -> ModelArgs:
        return ModelArgs(
            dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
            multiple_of=self.multiple_of, vocab_size=vocab_size, max_seq_len=self.seq_len, norm=self.norm, norm_p=self.norm_p,
            tie_embeddings=self.tie_embeddings,
        )

    def hyperparameters(self) -> Hyperparameters:
        """What the training step reads of these flags."""
        return Hyperparameters(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Hyperparameters)})

    def run_dir(self) -> Path:
        return Path(self.out) if self.out else Path("checkpoints") / (self.run_name or corpus_name(self.data))


# The model's shape: the flags that are ModelArgs fields. None takes the shape of the checkpoint
# a run resumes or starts from (--init-from); a run from scratch takes the field's "scratch" default.
MODEL_SHAPE = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name in {g.name for g in dataclasses.fields(ModelArgs)})


def add_arguments(parser, names=None, defaults=None) -> None:
    """A flag on parser for each TrainConfig field (or each one named), with its help text."""
    hints, defaults = typing.get_type_hints(TrainConfig), defaults or {}
    for f in dataclasses.fields(TrainConfig):
        if names is not None and f.name not in names:
            continue
        default = defaults.get(f.name, f.default)
        text = f.metadata["help"] + ("" if default in (None, False) else f" (default: {default})")
        if "scratch" in f.metadata and default is None:
            from_checkpoint = ", or the checkpoint's with --init-from or --resume" if names is None else ""
            text += f" (default: {f.metadata['scratch']}{from_checkpoint})"
        if "fresh" in f.metadata and default is None:
            text += f" (default: {f.metadata['fresh']}" + (", or the run's with --resume)" if names is None else ")")
        kind = next((a for a in typing.get_args(hints[f.name]) if a is not type(None)), hints[f.name])
        if kind is bool:
            parser.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            parser.add_argument(flag(f.name), type=kind, default=default, choices=f.metadata.get("choices"), help=text)


def finetune_config(cfg: TrainConfig, args: ModelArgs) -> TrainConfig:
    """cfg with the shape of the checkpoint it starts from; a shape flag that disagrees is refused."""
    theirs = {k: getattr(args, k) for k in MODEL_SHAPE}
    conflicts = [f"{flag(k)} {getattr(cfg, k)} (it has {theirs[k]})" for k in MODEL_SHAPE if getattr(cfg, k) not in (None, theirs[k])]
    if conflicts:
        raise ValueError(f"--init-from {cfg.init_from} fixes the model's shape, but {', '.join(conflicts)}; leave those flags out")
    if cfg.seq_len > args.max_seq_len:
        raise ValueError(f"--seq-len {cfg.seq_len} is longer than the context of {cfg.init_from} "
                         f"({args.max_seq_len} tokens); lower --seq-len")
    return dataclasses.replace(cfg, **theirs)
