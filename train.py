"""Train a small Llama on text: `python train.py` (built-in stories) or `--data FILE_OR_FOLDER`.

Fine-tune a checkpoint on your text with `--init-from CKPT`. One flag per TrainConfig field
(llama_mini/train_config.py, where each is described); the work happens in
llama_mini.training. Runs on one device as is, and on K processes (DDP, or FSDP2 with
--fsdp) under `torchrun --nproc_per_node=K train.py ...`.
"""

import argparse
import os
import sys

# OpenMP threads that wait by spinning stall when another process shares the cores, where
# threads that sleep while they wait do not. Must be set before torch loads its OpenMP
# runtime; an explicit OMP_WAIT_POLICY=ACTIVE wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from llama_mini.cli import run_main  # noqa: E402
from llama_mini.train_config import TrainConfig, add_arguments  # noqa: E402
from llama_mini.training import train  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    return p


def train_from_flags(argv=None) -> None:
    train(TrainConfig(**vars(parser().parse_args(argv))))


def main(argv=None) -> int:
    return run_main(train_from_flags, argv)


if __name__ == "__main__":
    sys.exit(main())
