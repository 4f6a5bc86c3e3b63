"""Training a small Llama: the schedule, the optimizer, a Trainer, the loop.

It reads top to bottom as nanoGPT's train.py does. The settings are a TrainConfig
(train_config.py, one field per train.py flag). lr_at and configure_optimizer are the
recipe. A Trainer draws a batch, computes the loss, takes an optimizer step and evaluates,
one step at a time, so other code (the norm ablation) can drive several. train() is the
loop around it: progress bar, evaluation, metrics, checkpoints, resume, Ctrl-C. The run
folder is run_folder.py's, the multi-process plumbing distributed.py's.

Exact resume is the design constraint that shapes the rest. Everything a step depends on
is either a function of the step number (the learning rate), saved in the checkpoint (the
weights, AdamW's moments, every RNG state: Trainer.state_dict) or kept out of the training
RNG's way (evaluation reads fixed windows). A run killed at any moment and resumed
therefore ends with bitwise the same weights as one that never stopped.
"""

import dataclasses
import math
import random
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .checkpoint import TOKENIZER, find_tokenizer, load_checkpoint
from .data import TokenSplits, load_tokenizer, open_corpus, tokenize
from .device import pick_device
from .distributed import ProcessGroup, full_state_dicts, gradient_sync, load_full_state_dicts, wrap_model
from .generation import generate
from .graceful_stop import GracefulStop
from .model import Transformer
from .run_folder import METRICS, MetricsLog, RunFolder, report_losses
from .tokenizer import Tokenizer
from .train_config import TrainConfig, finetune_config


class NonFiniteLoss(ValueError):
    """The loss or the gradient became NaN or infinite; the weights were not updated."""


# --- The recipe ---------------------------------------------------------------------------------


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then a cosine down to min_lr at max_steps (step counts from 0)."""
    min_lr = cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - min_lr)


def configure_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW that decays only matrices (weights and embeddings): decaying norm gains pulls
    them towards zero for no benefit (nanoGPT's configure_optimizers). The fused kernel is
    one launch for all tensors where torch has it; foreach otherwise."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = device.type in ("cuda", "cpu", "mps") and not cfg.fsdp
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused or None)


def sample_text(model: Transformer, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, seed=None) -> str:
    """prompt and the model's continuation, which stops early at an end of text (any of stop_ids)."""
    ids = tokenizer.encode(prompt, bos=True)
    max_new_tokens = max(0, min(max_new_tokens, model.args.max_seq_len - len(ids)))
    new = generate(model, [ids], max_new_tokens, temperature=0.6, top_p=0.9, eos_id=tokenizer.stop_ids, seed=seed)[0]
    return tokenizer.decode(ids + new)


# --- The trainer --------------------------------------------------------------------------------


class Trainer:
    """One run: its tokenizer, token windows, model and optimizer, and the data sampler's RNG.

    raw_model is the Transformer (sharded in place under FSDP); model is what a step calls,
    raw_model compiled and/or wrapped in DDP, as nanoGPT names them. The run folder is
    checked first and taken last, so a run refused for a flag, a file or its data leaves
    nothing behind.
    """

    def __init__(self, cfg: TrainConfig):
        self.group = ProcessGroup()
        self.device = pick_device(cfg.device, self.group.local_rank)
        if cfg.fsdp and self.group.world_size == 1:
            raise ValueError("--fsdp shards the model across processes; launch with torchrun --nproc_per_node=K")
        self.folder = RunFolder(cfg.run_dir(), cfg.resume)
        saved = self.folder.read_state() if cfg.resume else None
        if saved:
            cfg = self.folder.resumed_config(cfg, saved)
        self.group.join(self.device)
        try:
            self.build(cfg, saved)
            if self.group.is_main:
                self.folder.open(self.tokenizer.model_path)
        except BaseException:
            self.group.leave()
            raise

    def build(self, cfg: TrainConfig, saved: Optional[dict]) -> None:
        """Data, tokenizer, model and optimizer; restored from saved, or from --init-from."""
        self.corpus = open_corpus(cfg.data)  # checks the data before any work
        if saved and saved["data_digest"] != self.corpus.digest:
            raise ValueError(
                f"cannot --resume {self.folder.path}: it was trained on other data than "
                f"{cfg.data or 'the built-in stories'}; pass the --data it was trained on, or a new --out"
            )
        start = self.folder.latest or cfg.init_from
        source = load_checkpoint(start, dtype=torch.float32) if start else None
        if source and not saved:
            cfg = finetune_config(cfg, source.args)
        self.cfg = cfg
        self.tokenizer, self.tokens = self.prepare_data()
        self.args = source.args if source else cfg.model_args(self.tokenizer.n_words)
        if self.tokenizer.n_words > self.args.vocab_size:
            raise ValueError(f"{self.tokenizer.model_path} has {self.tokenizer.n_words} tokens, more than the "
                             f"{self.args.vocab_size} of {start}; pass that checkpoint's own tokenizer (--tokenizer)")
        torch.manual_seed(cfg.seed)  # the same seed on every process: every replica starts the same
        self.raw_model = Transformer(self.args).to(self.device)
        self.n_params = sum(p.numel() for p in self.raw_model.parameters())
        self.model = wrap_model(self.raw_model, self.group, self.device, cfg.fsdp, cfg.compile)
        self.optimizer = configure_optimizer(self.raw_model, cfg, self.device)
        self.data_rng = torch.Generator().manual_seed(cfg.seed)
        self.step, self.elapsed, self.grad_norm = 0, 0.0, math.nan
        if saved:
            self.load_state_dict({**saved, "model": source.state_dict()})
        elif source:  # fine-tuning: the weights, and a fresh optimizer
            load_full_state_dicts(self.raw_model, None, source.state_dict(), None, cfg.fsdp)
        cuda_bf16 = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        self.bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and cuda_bf16)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores: free speed

    def prepare_data(self):
        """The tokenizer (a resumed run's own, --tokenizer, the --init-from checkpoint's, or one
        trained on the data) and the token splits. The first process on each machine builds
        the caches; the others wait, then read them."""
        cfg, corpus = self.cfg, self.corpus
        path = self.folder.latest / TOKENIZER if self.folder.latest else cfg.tokenizer
        if path is None and cfg.init_from:
            path = find_tokenizer(cfg.init_from)
            if path is None:
                raise FileNotFoundError(f"no {TOKENIZER} in {cfg.init_from} or its parent; pass --tokenizer PATH")
        with self.group.local_rank_zero_first():
            tokenizer = Tokenizer(path) if path else load_tokenizer(corpus, cfg.vocab_size, cfg.cache_dir)
            tokens = TokenSplits(tokenize(corpus, tokenizer, cfg.cache_dir), cfg.val_fraction)
        tokens.check_seq_len(cfg.seq_len, corpus.name)
        prompt_len = len(tokenizer.encode(cfg.prompt))
        if cfg.sample_tokens and prompt_len >= cfg.seq_len:  # found out now, not after the training
            raise ValueError(f"--prompt is {prompt_len} tokens but the context (--seq-len) is {cfg.seq_len}; shorten it")
        return tokenizer, tokens

    # -- one step --

    def batch(self):
        """This process's share of the next global batch. Every process draws the same
        batch_size * world_size offsets from the same RNG and keeps its slice, so K
        processes see exactly the windows one process would with the whole batch."""
        B, T, rank = self.cfg.batch_size, self.cfg.seq_len, self.group.rank
        starts = self.tokens.random_starts("train", B * self.group.world_size, T, self.data_rng)
        x, y = self.tokens.windows("train", starts[rank * B : (rank + 1) * B], T)
        if self.device.type == "cuda":  # from pinned memory the copy overlaps with the GPU's work
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def loss(self, x, y) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else nullcontext():
            logits = self.model(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def train_step(self) -> float:
        """One optimizer step over grad_accum micro-batches; returns the mean train loss.
        A NaN or infinite loss or gradient raises NonFiniteLoss before the weights change."""
        cfg = self.cfg
        lr = lr_at(self.step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)
        for micro in range(cfg.grad_accum):
            x, y = self.batch()
            with gradient_sync(self.raw_model, self.model, sync=micro == cfg.grad_accum - 1):
                loss = self.loss(x, y) / cfg.grad_accum
                loss.backward()
            total += loss.detach()
        total = self.group.sum(total) / self.group.world_size
        norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), cfg.grad_clip or math.inf)
        if hasattr(norm, "full_tensor"):  # FSDP: a DTensor
            norm = norm.full_tensor()
        loss, norm = torch.stack([total, norm.to(total)]).tolist()
        if not (math.isfinite(loss) and math.isfinite(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            what, value = ("loss", loss) if not math.isfinite(loss) else ("gradient norm", norm)
            raise NonFiniteLoss(
                f"{what} is {value} at step {self.step + 1}; stopped before updating the weights, and {self.last_good()}. "
                "Lower --lr (or raise --warmup-steps) and --resume"
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.grad_norm = norm
        return loss

    def last_good(self) -> str:
        latest = self.folder.latest
        return f"the last good checkpoint is {latest}" if latest else "no checkpoint was saved yet"

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean loss and perplexity on the same eval_iters * batch_size windows of the
        validation split every time, spread evenly over it; shared out among processes."""
        B, T, world = self.cfg.batch_size, self.cfg.seq_len, self.group.world_size
        starts = self.tokens.even_starts("val", self.cfg.eval_iters * B * world, T).view(world, -1)[self.group.rank]
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for chunk in starts.split(B):
            x, y = self.tokens.windows("val", chunk, T)
            total += self.loss(x.to(self.device), y.to(self.device)) * len(chunk)
        self.model.train()
        val_loss = self.group.sum(total).item() / len(starts) / world
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700))}

    def sample(self, prompt: str, max_new_tokens: int) -> str:
        """The model's continuation of prompt (temperature 0.6, top-p 0.9, seeded by cfg.seed)."""
        if self.cfg.fsdp:
            raise ValueError("a sharded (--fsdp) model cannot sample in place; sample load_checkpoint(run folder)")
        self.raw_model.eval()
        try:
            return sample_text(self.raw_model, self.tokenizer, prompt, max_new_tokens, seed=self.cfg.seed)
        finally:
            self.raw_model.train()

    # -- state --

    def state_dict(self) -> dict:
        """Everything the next step depends on, as whole tensors (gathered from the shards
        under FSDP: a collective, every process calls it)."""
        model, optimizer = full_state_dicts(self.raw_model, self.optimizer, self.cfg.fsdp)
        return {
            "model": model, "optimizer": optimizer, "step": self.step, "elapsed": self.elapsed,
            "data_rng": self.data_rng.get_state(), "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python_rng": random.getstate(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where state_dict() was taken."""
        load_full_state_dicts(self.raw_model, self.optimizer, state["model"], state["optimizer"], self.cfg.fsdp)
        self.step, self.elapsed = state["step"], state["elapsed"]
        self.data_rng.set_state(state["data_rng"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        random.setstate(state["python_rng"])

    def close(self, wait_for_all: bool = False) -> None:
        self.group.leave(wait_for_all)
        self.folder.close()


# --- The loop -----------------------------------------------------------------------------------


def train(cfg: TrainConfig) -> Path:
    """Train (or resume, or fine-tune) the run described by cfg; returns its run folder.

    Ctrl-C saves a checkpoint at the end of the current step and re-raises KeyboardInterrupt;
    a non-finite loss raises NonFiniteLoss (a ValueError) and leaves the last checkpoint as is.
    """
    trainer = Trainer(cfg)
    finished = False
    try:
        run(trainer)
        finished = True
    finally:
        trainer.close(wait_for_all=finished)
    return trainer.folder.path


def run(trainer: Trainer) -> None:
    cfg, main, folder = trainer.cfg, trainer.group.is_main, trainer.folder
    log = MetricsLog(folder.path / METRICS, trainer.step) if main else None
    if main:
        print(describe(trainer))
    # A bar on a terminal only (disable=None): in a log file its redraws are noise.
    bar = tqdm(total=cfg.max_steps, initial=trainer.step, disable=None if main else True, unit="step", dynamic_ncols=True)
    try:
        with GracefulStop() as stop:
            fit(trainer, log, bar, stop)
    except KeyboardInterrupt:
        bar.close()
        if main:
            latest = f"the latest checkpoint is {folder.latest}" if folder.latest else "no checkpoint was saved"
            print(f"interrupted at step {trainer.step}; {latest}; continue with the same flags and --resume")
        raise
    finally:
        bar.close()
        if log:
            log.close()
    if main:
        report_losses(folder.path)
    if main and cfg.sample_tokens:
        model = load_checkpoint(folder.latest).to(trainer.device)  # the saved model, as a user would load it
        text = sample_text(model, trainer.tokenizer, cfg.prompt, cfg.sample_tokens, seed=cfg.seed)
        print(f"\nsample from {folder.latest}:\n{text}\n")


def describe(trainer: Trainer) -> str:
    cfg, args, world = trainer.cfg, trainer.args, trainer.group.world_size
    n_train = len(trainer.tokens.splits["train"])
    start = f"; resuming at step {trainer.step}" if trainer.step else f"; fine-tuning {cfg.init_from}" if cfg.init_from else ""
    return (
        f"{trainer.n_params / 1e6:.2f}M parameters (dim {args.dim}, {args.n_layers} layers, vocab {args.vocab_size}); "
        f"{n_train / 1e6:.2f}M training tokens; {trainer.device} {'bfloat16' if trainer.bf16 else 'float32'}"
        f"{f' x {world} processes' if world > 1 else ''}; run folder {trainer.folder.path}{start}"
    )


def fit(trainer: Trainer, log: Optional[MetricsLog], bar: tqdm, stop: GracefulStop) -> None:
    """Train to cfg.max_steps: evaluate, log and save on schedule; stop at a signal, saved."""
    cfg, main = trainer.cfg, trainer.group.is_main
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * trainer.group.world_size
    if trainer.step == 0:
        first = trainer.evaluate()
        if main:
            log.write({"step": 0, "time": 0.0, **first})
    tick = time.perf_counter()
    while trainer.step < cfg.max_steps:
        loss = trainer.train_step()
        dt = time.perf_counter() - tick
        trainer.elapsed += dt
        lr = lr_at(trainer.step - 1, cfg)
        record = {"step": trainer.step, "time": round(trainer.elapsed, 3), "train_loss": loss, "lr": lr,
                  "grad_norm": trainer.grad_norm, "tokens_per_s": round(tokens_per_step / dt, 1)}
        bar.set_postfix(dict(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{record['tokens_per_s']:,.0f}"), refresh=False)
        bar.update()
        done = trainer.step == cfg.max_steps
        if trainer.step % cfg.eval_every == 0 or done:
            record.update(trainer.evaluate())
            if main:
                bar.write(f"step {trainer.step}: val loss {record['val_loss']:.4f}, perplexity {record['val_ppl']:.2f}")
        if main:
            log.write(record)
        stopping = trainer.group.any(stop.requested, trainer.device)
        if trainer.step % cfg.save_every == 0 or done or stopping:
            save(trainer)
        if stopping:
            raise KeyboardInterrupt
        tick = time.perf_counter()  # evaluation and saving are not training time


def save(trainer: Trainer) -> None:
    """A checkpoint of the trainer's state in its run folder, refused if the weights are not
    finite: the checkpoint `latest` names is one a run can go on from."""
    state = trainer.state_dict()  # a collective under FSDP: every process calls it
    if not trainer.group.is_main:
        return
    bad = next((k for k, v in state["model"].items() if not torch.isfinite(v).all()), None)
    if bad:
        raise NonFiniteLoss(f"the weights hold NaN or inf after step {trainer.step} ({bad}); not saved, and "
                            f"{trainer.last_good()}. Lower --lr (or raise --warmup-steps) and --resume")
    meta = {"config": dataclasses.asdict(trainer.cfg), "data_digest": trainer.corpus.digest}
    trainer.folder.save(trainer.step, trainer.args, state, meta, trainer.cfg.keep_checkpoints)
