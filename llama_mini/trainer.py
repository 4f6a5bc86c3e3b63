"""The training step: the recipe (learning-rate schedule, optimizer) and a Trainer that takes
one optimizer step at a time, for train.py's loop and the norm ablation to drive.

A Trainer holds a run's model, optimizer and data, and draws a batch, computes the loss, takes an
optimizer step and evaluates. run/start.py's start_run sets one up from a TrainConfig (the
run folder, data, tokenizer, model and processes).

Exact resume is the design constraint that shapes the rest. Everything a step depends on
is either a function of the step number (the learning rate), saved in the checkpoint (the
weights, AdamW's moments, every RNG state: Trainer.state_dict) or kept out of the training
RNG's way (evaluation reads fixed windows). A run killed at any moment and resumed
therefore ends with bitwise the same weights as one that never stopped.
"""

import dataclasses
import math
import random
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from .bits_per_byte import TextBytes, bits_per_byte
from .generation import generate
from .model import ModelArgs, Transformer
from .tokenizers.base import Tokenizer
from .run.config import TrainConfig
from .run.distributed import full_state_dicts, gradient_sync, load_full_state_dicts


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


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), PaLM's estimate as in nanoGPT: 6 per
    weight that multiplies (the embedding lookup does not), plus attention's scores and
    mixing, 12 * n_layers * dim * seq_len."""
    attention = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.n_kv_heads)  # wq, wo; wk, wv
    per_layer = attention + 3 * args.dim * args.ffn_dim  # + w1, w2, w3
    matmul_weights = args.n_layers * per_layer + args.dim * args.vocab_size
    return 6 * matmul_weights + 12 * args.n_layers * args.dim * seq_len


def sample_text(model: Transformer, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, seed=None) -> str:
    """prompt and the model's continuation, which stops early at an end of text (any of stop_ids)."""
    ids = tokenizer.encode(prompt, bos=True)
    max_new_tokens = max(0, min(max_new_tokens, model.args.max_seq_len - len(ids)))
    new = generate(model, [ids], max_new_tokens, eos_id=tokenizer.stop_ids, seed=seed)[0]  # Meta's sampling defaults
    return tokenizer.decode(ids + new)


# --- The trainer --------------------------------------------------------------------------------


class Trainer:
    """One run's model, optimizer and data, and the data sampler's RNG, stepped one optimizer step
    at a time; run/start.py's start_run builds one from a TrainConfig.

    raw_model is the Transformer (sharded in place under FSDP, blocks compiled in place under
    --compile); model is what a step calls, raw_model or it in DDP, as nanoGPT names them.
    tokens are the token windows, group the processes (run/distributed.py); folder is the
    run folder save() writes to, tokenizer and corpus what the run reads.
    """

    def __init__(self, cfg: TrainConfig, raw_model: Transformer, model, optimizer, tokens, group, device, folder,
                 tokenizer: Tokenizer, corpus):
        self.cfg, self.raw_model, self.model, self.optimizer = cfg, raw_model, model, optimizer
        self.tokens, self.group, self.device = tokens, group, device
        self.folder, self.tokenizer, self.corpus = folder, tokenizer, corpus
        self.text_bytes = TextBytes(tokenizer)
        self.args = raw_model.args
        self.n_params = sum(p.numel() for p in raw_model.parameters())
        self.data_rng = torch.Generator().manual_seed(cfg.seed)
        self.step, self.elapsed, self.grad_norm = 0, 0.0, math.nan
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        self.bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and cuda_bf16)

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
                f"{what} is {value} at step {self.step + 1}; stopped before updating the weights, and {self.how_to_go_on()}"
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.grad_norm = norm
        return loss

    def describe(self) -> str:
        """One line: the model, the data, the device and the run folder."""
        cfg, args, world = self.cfg, self.args, self.group.world_size
        start = f"; resuming at step {self.step}" if self.step else f"; fine-tuning {cfg.init_from}" if cfg.init_from else ""
        return (
            f"{self.n_params / 1e6:.2f}M parameters (dim {args.dim}, {args.n_layers} layers, vocab {args.vocab_size}); "
            f"{len(self.tokens.splits['train']) / 1e6:.2f}M training tokens; {self.device} {'bfloat16' if self.bf16 else 'float32'}"
            f"{f' x {world} processes' if world > 1 else ''}; run folder {self.folder.path}{start}"
        )

    def how_to_go_on(self) -> str:
        """Where a run stopped for NaN can go on from, and how: --resume, or before the first
        checkpoint a new start (--resume would find nothing to resume)."""
        latest = self.folder.latest
        if latest:
            return f"the last good checkpoint is {latest}. Lower --lr (or raise --warmup-steps) and --resume"
        return ("no checkpoint was saved yet. Lower --lr (or raise --warmup-steps) and start again "
                "(there is no checkpoint to --resume)")

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean loss (nats per token), perplexity and bits per byte on the same eval_iters *
        batch_size windows of the validation split every time, spread evenly over it; shared
        out among processes."""
        B, T, world = self.cfg.batch_size, self.cfg.seq_len, self.group.world_size
        starts = self.tokens.even_starts("val", self.cfg.eval_iters * B * world, T).view(world, -1)[self.group.rank]
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.device)  # nats, bytes
        for chunk in starts.split(B):
            x, y = self.tokens.windows("val", chunk, T)
            nats = self.loss(x.to(self.device), y.to(self.device)).double() * y.numel()
            total += torch.stack([nats, torch.tensor(self.text_bytes.count(x, y), dtype=torch.float64, device=self.device)])
        self.model.train()
        nats, n_bytes = self.group.sum(total).tolist()
        val_loss = nats / (len(starts) * world * T)
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700)), "val_bpb": bits_per_byte(nats, n_bytes)}

    def sample(self, prompt: str, max_new_tokens: int) -> str:
        """The model's continuation of prompt (Meta's sampling defaults, seeded by cfg.seed)."""
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

    def save(self) -> None:
        """A checkpoint of this state in the run folder, refused if the weights are not finite:
        the checkpoint `latest` names is one a run can go on from."""
        state = self.state_dict()  # a collective under FSDP: every process calls it
        if not self.group.is_main:
            return
        bad = next((k for k, v in state["model"].items() if not torch.isfinite(v).all()), None)
        if bad:
            raise NonFiniteLoss(f"the weights hold NaN or inf after step {self.step} ({bad}); not saved, and {self.how_to_go_on()}")
        meta = {"config": dataclasses.asdict(self.cfg), "data_digest": self.corpus.digest}
        self.folder.save(self.step, self.args, state, meta, self.cfg.keep_checkpoints)

    def close(self, wait_for_all: bool = False) -> None:
        self.group.leave(wait_for_all)
        self.folder.close()
