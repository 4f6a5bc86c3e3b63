"""Train a small Llama on text: `python train.py` (built-in stories) or `--data FILE_OR_FOLDER`.

Fine-tune a checkpoint on your text with `--init-from CKPT`. This file is the loop: step,
evaluate, log, save. The step is llama_mini/trainer.py, the model llama_mini/model.py, and a
run's machinery (flags, data, run folder, evaluation, checkpoints, resume, processes)
llama_mini/run/. Runs on one device as is, and on K processes (DDP, or FSDP2 with --fsdp)
under `torchrun --nproc_per_node=K train.py ...`.
"""

import argparse
import os
import time
from contextlib import contextmanager
from pathlib import Path

# OpenMP threads that wait by spinning stall when another process shares the cores, where
# threads that sleep while they wait do not. Must be set before torch loads its OpenMP
# runtime; an explicit OMP_WAIT_POLICY=ACTIVE wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from llama_mini.support.cli import run_main  # noqa: E402
from llama_mini.support.device import bfloat16_notice  # noqa: E402
from llama_mini.formats import load_checkpoint  # noqa: E402
from llama_mini.trainer import NonFiniteLoss  # noqa: E402
from llama_mini.run.config import TrainConfig, add_arguments  # noqa: E402
from llama_mini.run.distributed import exit_process  # noqa: E402
from llama_mini.run.start import start_run  # noqa: E402
from llama_mini.run.folder import METRICS, MetricsLog, report_losses  # noqa: E402
from llama_mini.run.signals import GracefulStop  # noqa: E402
from llama_mini.run.training_run import sample_text  # noqa: E402


def train(cfg: TrainConfig) -> Path:
    """Train (or resume, or fine-tune) the run described by cfg; returns its run folder.

    Ctrl-C (or SIGTERM) saves a checkpoint at the end of the current step and raises
    KeyboardInterrupt; a non-finite loss raises NonFiniteLoss (a ValueError) and leaves the last
    checkpoint as it was.
    """
    run = start_run(cfg)  # the run folder (checked, then locked), data, model, optimizer; resumed if asked
    cfg, trainer = run.cfg, run.trainer
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * run.group.world_size
    with training(run) as (log, bar), GracefulStop() as stop:
        if trainer.step == 0:
            log({"step": 0, "time": 0.0, **run.evaluate()})
        tick = time.perf_counter()
        while trainer.step < cfg.max_steps:
            loss = train_step(run)
            dt = time.perf_counter() - tick
            run.elapsed += dt
            record = {"step": trainer.step, "time": round(run.elapsed, 3), "train_loss": loss, "lr": trainer.lr,
                      "grad_norm": trainer.grad_norm, "tokens_per_s": round(tokens_per_step / dt, 1)}
            bar.set_postfix(dict(loss=f"{loss:.3f}", lr=f"{trainer.lr:.2e}", tok_s=f"{record['tokens_per_s']:,.0f}"),
                            refresh=False)
            bar.update()
            done = trainer.step == cfg.max_steps
            if trainer.step % cfg.eval_every == 0 or done:
                record.update(evaluate(run, bar))
            log(record)
            stopping = run.group.any(stop.requested, run.device)
            if trainer.step % cfg.save_every == 0 or done or stopping:
                run.save()
            if stopping:
                raise KeyboardInterrupt
            tick = time.perf_counter()  # evaluation and saving are not training time
    if run.group.is_main:
        report_losses(run.folder.path)
        if cfg.sample_tokens:
            print_sample(run)
    return run.folder.path


@contextmanager
def training(run):
    """While the run trains: a function that writes a record to its metrics log (on the main
    process only), and its progress bar. Afterwards the run is closed, after Ctrl-C with a line
    saying how to go on; the processes wait for each other only after a run that finished."""
    main, log, finished = run.group.is_main, None, False
    # A progress bar on a terminal only (disable=None): in a log file its redraws are noise.
    bar = tqdm(total=run.cfg.max_steps, initial=run.trainer.step, disable=None if main else True, unit="step",
               dynamic_ncols=True)
    try:
        if main:
            log = MetricsLog(run.folder.path / METRICS, run.trainer.step)
            print(run.describe())
            if run.trainer.bf16 and (notice := bfloat16_notice(run.device, torch.bfloat16, "--dtype")):
                print(notice)
        yield (log.write if log else lambda record: None), bar
        finished = True
    except KeyboardInterrupt:
        bar.close()
        if main:
            print(interrupted(run))
        raise
    finally:
        bar.close()
        if log:
            log.close()
        run.close(wait_for_all=finished)


def train_step(run) -> float:
    """One optimizer step's train loss; a non-finite one stops the run, saying how to go on."""
    try:
        return run.trainer.train_step()
    except NonFiniteLoss as e:
        raise NonFiniteLoss(f"{e}, and {run.how_to_go_on()}") from None


def evaluate(run, bar) -> dict:
    """The validation loss, perplexity and bits per byte, printed above the progress bar."""
    metrics = run.evaluate()
    if run.group.is_main:
        bar.write(f"step {run.trainer.step}: val loss {metrics['val_loss']:.4f} nats/token, "
                  f"{metrics['val_bpb']:.4f} bits/byte, perplexity {metrics['val_ppl']:.2f}")
    return metrics


def interrupted(run) -> str:
    """Where an interrupted run stopped, and how to go on: --resume, or before the first
    checkpoint a new start (--resume would find nothing to resume)."""
    if run.folder.latest:
        return (f"interrupted at step {run.trainer.step}; the latest checkpoint is {run.folder.latest}; "
                "continue with the same flags and --resume")
    return (f"interrupted at step {run.trainer.step}, before the first checkpoint; run the same command "
            "again to start over (there is no checkpoint to --resume)")


def print_sample(run) -> None:
    """A sample of --sample-tokens after --prompt from the saved model, loaded as a user would load it."""
    model = load_checkpoint(run.folder.latest).to(run.device)
    text = sample_text(model, run.tokenizer, run.cfg.prompt, run.cfg.sample_tokens, seed=run.cfg.seed)
    print(f"\nsample from {run.folder.latest}:\n{text}\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)  # one flag per TrainConfig field, with its help text
    return run_main(lambda args: train(TrainConfig(**vars(parser.parse_args(args)))), argv)


if __name__ == "__main__":
    exit_process(main())
