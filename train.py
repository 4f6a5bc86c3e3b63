"""Train a small Llama on text: `python train.py` (built-in stories) or `--data FILE_OR_FOLDER`.

One flag per TrainConfig field; the work happens in llama_mini.training. Runs on one
device as is, and on K processes (DDP, or FSDP2 with --fsdp) under
`torchrun --nproc_per_node=K train.py ...`.
"""

import argparse
import dataclasses
import os
import sys
import typing

# OpenMP threads that wait by spinning stall when another process shares the cores: a step
# measured 5x slower on 2 busy cores than with threads that sleep while they wait. Must be
# set before torch loads its OpenMP runtime; an explicit OMP_WAIT_POLICY=ACTIVE wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from llama_mini.model import NORMS  # noqa: E402
from llama_mini.training import DTYPES, TrainConfig, train  # noqa: E402

HELP = {
    "data": "a UTF-8 .txt file or a folder of them (default: the built-in stories)",
    "out": "run folder for checkpoints and metrics (default: checkpoints/<run-name>)",
    "run_name": "name of the run folder under checkpoints/ (default: the data's name)",
    "cache_dir": "where trained tokenizers and tokenised data are cached",
    "tokenizer": "use this tokenizer.model instead of training one on the data",
    "vocab_size": "vocabulary size of the tokenizer trained on the data",
    "val_fraction": "fraction of the tokens held out for validation",
    "dim": "model width",
    "n_layers": "number of Transformer blocks",
    "n_heads": "attention heads",
    "n_kv_heads": "key/value heads for grouped-query attention (default: n_heads)",
    "norm": "normalisation layer",
    "norm_p": "fraction of each vector partial RMSNorm (prmsnorm) reads",
    "tie_embeddings": "share the token embedding with the output layer (--no-tie-embeddings: Llama-2's own)",
    "max_steps": "optimizer steps to train for",
    "batch_size": "sequences per micro-step per process",
    "seq_len": "tokens per training sequence (the context length)",
    "grad_accum": "micro-steps accumulated into one optimizer step",
    "lr": "peak learning rate",
    "min_lr": "learning rate at the end of the cosine (default: lr / 10)",
    "warmup_steps": "steps of linear learning-rate warmup",
    "weight_decay": "AdamW weight decay (matrices only)",
    "grad_clip": "clip the gradient norm to this (0: no clipping)",
    "seed": "seed for initialisation, data order and the final sample",
    "resume": "continue the run in --out from its latest checkpoint",
    "save_every": "save a checkpoint every N steps",
    "keep_checkpoints": "how many of the newest checkpoints to keep",
    "eval_every": "evaluate on the validation split every N steps",
    "eval_iters": "batches per evaluation",
    "sample_tokens": "length of the sample printed at the end (0: none)",
    "prompt": "start of the sample printed at the end",
    "device": "cuda, mps or cpu (default: the first available, in that order)",
    "dtype": "auto: bfloat16 autocast on CUDA, float32 elsewhere",
    "compile": "torch.compile the model",
    "fsdp": "shard the model with FSDP2 (fully_shard per block) under torchrun",
}
CHOICES = {"norm": NORMS, "dtype": DTYPES}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    hints = typing.get_type_hints(TrainConfig)
    for field in dataclasses.fields(TrainConfig):
        name = "--" + field.name.replace("_", "-")
        kind = hints[field.name]
        text = HELP[field.name] + ("" if field.default in (None, False) else f" (default: {field.default})")
        if kind is bool:
            p.add_argument(name, action=argparse.BooleanOptionalAction, default=field.default, help=text)
            continue
        kind = next((a for a in typing.get_args(kind) if a is not type(None)), kind)  # Optional[int] -> int
        p.add_argument(name, type=kind, default=field.default, choices=CHOICES.get(field.name), help=text)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        train(TrainConfig(**vars(args)))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a read-only folder: say which file and why
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
