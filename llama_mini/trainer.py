"""The training step: the recipe (learning-rate schedule, optimizer) and a Trainer that takes
one optimizer step at a time, for train.py's loop and the norm ablation to drive.

A Trainer is given everything a step uses: the model and its optimizer, the hyperparameters,
the batches and, for K processes, how to synchronise the gradients and average the loss. It
knows nothing of flags, folders, tokenizers or processes: llama_mini/run/ builds one from
train.py's flags (run/start.py) and does what a run does besides stepping (run/training_run.py:
evaluation, samples, checkpoints).

The recipe is Llama's by default, AdamW with a cosine schedule, or that of the speedrun
anchors (modded-nanogpt, nanochat): Muon on the blocks' matrices with AdamW on the rest, and a
warmup-stable-decay schedule.

Exact resume is the design constraint that shapes the rest. Everything a step depends on
is either a function of the step number (the learning rate), state a checkpoint keeps (the
weights, the optimizers' moments, the step, the batches' RNG and every other RNG) or kept out
of the training RNG's way (evaluation reads fixed windows). A run killed at any moment and
resumed therefore ends with bitwise the same weights as one that never stopped.
"""

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator, Optional

import torch
import torch.nn.functional as F

from .model import ModelArgs


class NonFiniteLoss(ValueError):
    """The loss or the gradient became NaN or infinite; the weights were not updated."""


# --- The recipe ---------------------------------------------------------------------------------


@dataclass
class Hyperparameters:
    """What a training step reads of the recipe (train.py's flags: TrainConfig.hyperparameters())."""

    lr: float  # the peak learning rate
    min_lr: Optional[float]  # at the end of the cosine; None: lr / 10
    warmup_steps: int
    max_steps: int
    weight_decay: float  # matrices only
    grad_clip: float  # the largest gradient norm; 0: no clipping
    grad_accum: int  # micro-batches per optimizer step
    optimizer: str = "adamw"  # one of OPTIMIZERS
    lr_schedule: str = "cosine"  # one of LR_SCHEDULES


OPTIMIZERS = ("adamw", "muon")
LR_SCHEDULES = ("cosine", "wsd")
DECAY_FRACTION = 0.2  # wsd: the last fifth of the steps decays (nanochat's warmdown ratio)


def lr_at(step: int, hp: Hyperparameters) -> float:
    """Linear warmup to hp.lr (step counts from 0), then down to min_lr at max_steps: along a
    cosine, or (wsd) held at lr and decayed linearly over the last DECAY_FRACTION of the steps."""
    min_lr = hp.lr / 10 if hp.min_lr is None else hp.min_lr
    if step < hp.warmup_steps:
        return hp.lr * (step + 1) / hp.warmup_steps
    if hp.lr_schedule == "wsd":
        decay_steps = max(1, round(DECAY_FRACTION * hp.max_steps))
        progress = min(1.0, max(0.0, (step - (hp.max_steps - decay_steps)) / decay_steps))
        return hp.lr - progress * (hp.lr - min_lr)
    progress = min(1.0, (step - hp.warmup_steps) / max(1, hp.max_steps - hp.warmup_steps))
    return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (hp.lr - min_lr)


def configure_optimizer(model: torch.nn.Module, hp: Hyperparameters, device: torch.device, sharded: bool = False):
    """AdamW that decays only matrices (weights and embeddings): decaying norm gains pulls
    them towards zero for no benefit (nanoGPT's configure_optimizers). The fused kernel is
    one launch for all tensors where torch has it (not for FSDP's sharded parameters); foreach
    otherwise. With hp.optimizer "muon", the blocks' matrices go to Muon instead (Optimizers)."""
    params = [p for p in model.parameters() if p.requires_grad]
    muon = [p for name, p in model.named_parameters() if p.requires_grad and hp.optimizer == "muon" and is_block_matrix(name, p)]
    rest = [p for p in params if all(p is not q for q in muon)]
    groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": hp.weight_decay},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = device.type in ("cuda", "cpu", "mps") and not sharded
    adamw = torch.optim.AdamW(groups, lr=hp.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused or None)
    if not muon:
        return adamw
    # match_rms_adamw scales each matrix's orthogonalised update to AdamW's size (0.2 * sqrt of
    # its larger side; Moonshot's "Muon is Scalable"), so --lr and --weight-decay mean what they
    # mean for AdamW.
    return Optimizers(torch.optim.Muon(muon, lr=hp.lr, weight_decay=hp.weight_decay, adjust_lr_fn="match_rms_adamw"), adamw)


def is_block_matrix(name: str, p: torch.Tensor) -> bool:
    """The 2-D weights of the Transformer blocks (attention's and the feed-forward's): Muon's
    share; the embedding, the head and the norm gains stay with AdamW, as nanochat splits them."""
    return p.dim() == 2 and name.split(".")[0] == "layers"


class Optimizers:
    """Several optimizers stepped as one (Muon and AdamW): their param groups in one list, so the
    schedule sets every group's lr; their states side by side in one state dict."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list:
        """Read anew each time: an optimizer's load_state_dict replaces its groups."""
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def step(self):
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True):
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {type(optimizer).__name__: optimizer.state_dict() for optimizer in self.optimizers}

    def load_state_dict(self, state: dict) -> None:
        for optimizer in self.optimizers:
            optimizer.load_state_dict(state[type(optimizer).__name__])


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), PaLM's estimate as in nanoGPT: 6 per
    weight that multiplies (the embedding lookup does not), plus attention's scores and
    mixing, 12 * n_layers * dim * seq_len."""
    matmul_weights = args.n_layers * args.block_weights + args.dim * args.vocab_size
    return 6 * matmul_weights + 12 * args.n_layers * args.dim * seq_len


# --- The trainer --------------------------------------------------------------------------------


class Trainer:
    """A model trained one optimizer step at a time.

    model is what a step calls: a Transformer, or one wrapped for DDP (nanoGPT's model, where
    raw_model is the Transformer). batches gives each micro-batch's (inputs, targets) on the
    model's device. bf16 runs the forward under bfloat16 autocast. For K processes,
    gradient_sync(last) is the context each micro-batch's backward runs in (last: the
    accumulation's last micro-batch, whose gradients the processes exchange) and average(loss)
    the mean over the processes; on one process neither has anything to do.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, hp: Hyperparameters,
                 batches: Iterator[tuple[torch.Tensor, torch.Tensor]], bf16: bool = False,
                 gradient_sync: Callable[[bool], ContextManager] = nullcontext,
                 average: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss):
        self.model, self.optimizer, self.hp, self.batches, self.bf16 = model, optimizer, hp, batches, bf16
        self.gradient_sync, self.average = gradient_sync, average
        self.step = 0  # optimizer steps taken: the schedule's position, saved in a checkpoint
        self.lr, self.grad_norm = math.nan, math.nan  # the last step's

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy (nats per token) of the model's next-token predictions y after x."""
        with torch.autocast(x.device.type, dtype=torch.bfloat16) if self.bf16 else nullcontext():
            logits = self.model(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def train_step(self) -> float:
        """One optimizer step over grad_accum micro-batches; returns the mean train loss.
        A NaN or infinite loss or gradient raises NonFiniteLoss before the weights change."""
        hp = self.hp
        self.lr = lr_at(self.step, hp)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        total = 0.0
        for micro in range(hp.grad_accum):
            x, y = next(self.batches)
            with self.gradient_sync(micro == hp.grad_accum - 1):
                loss = self.loss(x, y) / hp.grad_accum
                loss.backward()
            total += loss.detach()
        total = self.average(total)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), hp.grad_clip or math.inf)
        if hasattr(norm, "full_tensor"):  # FSDP: a DTensor
            norm = norm.full_tensor()
        loss, norm = torch.stack([total, norm.to(total)]).tolist()
        if not (math.isfinite(loss) and math.isfinite(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            what, value = ("loss", loss) if not math.isfinite(loss) else ("gradient norm", norm)
            raise NonFiniteLoss(f"{what} is {value} at step {self.step + 1}; stopped before updating the weights")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.grad_norm = norm
        return loss
