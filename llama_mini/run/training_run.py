"""A training run: its Trainer, and what a run does besides stepping.

start_run (start.py) builds one from train.py's flags; train.py's loop and the ablation drive
it. The step is the Trainer's (llama_mini/trainer.py), on the model and batches it was given.
Here is the rest: the run's description for the log, evaluation (loss, perplexity and bits per
byte, which takes the tokenizer), a sample of a model's text (sample_text), and checkpoints of
the whole state (gathered from the shards under FSDP), refused when the weights are not
finite, and the resume from one, exact to the bit.
"""

import dataclasses
import math
import random
from dataclasses import dataclass

import torch

from ..support.bits_per_byte import TextBytes, bits_per_byte
from ..generation import generate
from ..model import Transformer, check_fits_context
from ..tokenizers.base import Tokenizer
from ..trainer import NonFiniteLoss, Trainer
from .config import TrainConfig
from .data import Corpus, TokenSplits, TrainBatches
from .distributed import ProcessGroup, full_state_dicts, load_full_state_dicts
from .folder import RunFolder


def sample_text(model: Transformer, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, seed=None) -> str:
    """prompt and the model's continuation, as long as max_new_tokens or the context allows;
    it stops early at an end of text (any of stop_ids). Meta's sampling defaults."""
    ids = tokenizer.encode(prompt, bos=True)
    room = check_fits_context(model.args, len(ids), f"the prompt of {len(ids)} tokens", "shorten it")
    new = generate(model, [ids], min(max_new_tokens, room), eos_id=tokenizer.stop_ids, seed=seed)[0]
    return tokenizer.decode(ids + new)


@dataclass(eq=False)
class TrainingRun:
    """One run's flags, its Trainer and what the Trainer steps, and what the run reads and writes.

    raw_model is the Transformer (sharded in place under FSDP, blocks compiled in place under
    --compile); trainer.model is what a step calls, raw_model or it in DDP. batches are the
    Trainer's, tokens the splits they and evaluation read, group the processes
    (run/distributed.py), folder the run folder save() writes to.
    """

    cfg: TrainConfig
    trainer: Trainer
    raw_model: Transformer
    batches: TrainBatches
    tokens: TokenSplits
    tokenizer: Tokenizer
    corpus: Corpus
    folder: RunFolder
    group: ProcessGroup
    device: torch.device
    elapsed: float = 0.0  # seconds of training steps so far (evaluation and saving excluded)

    def __post_init__(self):
        self.args = self.raw_model.args
        self.n_params = sum(p.numel() for p in self.raw_model.parameters())
        self.text_bytes = TextBytes(self.tokenizer)

    def describe(self) -> str:
        """One line: the model, the data, the device and the run folder."""
        cfg, args, world, step = self.cfg, self.args, self.group.world_size, self.trainer.step
        start = f"; resuming at step {step}" if step else f"; fine-tuning {cfg.init_from}" if cfg.init_from else ""
        return (
            f"{self.n_params / 1e6:.2f}M parameters (dim {args.dim}, {args.n_layers} layers, vocab {args.vocab_size}); "
            f"{len(self.tokens.splits['train']) / 1e6:.2f}M training tokens; {self.device} "
            f"{'bfloat16' if self.trainer.bf16 else 'float32'}{', subnormals flushed' if cfg.flush_denormals else ''}"
            f"{f' x {world} processes' if world > 1 else ''}; "
            f"run folder {self.folder.path}{start}"
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
        model = self.trainer.model
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.device)  # nats, bytes
        for chunk in starts.split(B):
            x, y = self.tokens.windows("val", chunk, T)
            nats = self.trainer.loss(x.to(self.device), y.to(self.device)).double() * y.numel()
            total += torch.stack([nats, torch.tensor(self.text_bytes.count(x, y), dtype=torch.float64, device=self.device)])
        model.train()
        nats, n_bytes = self.group.sum(total).tolist()
        val_loss = nats / (len(starts) * world * T)
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700)), "val_bpb": bits_per_byte(nats, n_bytes)}

    # -- state --

    def state_dict(self) -> dict:
        """Everything the next step depends on, as whole tensors (gathered from the shards
        under FSDP: a collective, every process calls it)."""
        model, optimizer = full_state_dicts(self.raw_model, self.trainer.optimizer, self.cfg.fsdp)
        return {
            "model": model, "optimizer": optimizer, "step": self.trainer.step, "elapsed": self.elapsed,
            "data_rng": self.batches.rng.get_state(), "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python_rng": random.getstate(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where state_dict() was taken."""
        load_full_state_dicts(self.raw_model, self.trainer.optimizer, state["model"], state["optimizer"], self.cfg.fsdp)
        self.trainer.step, self.elapsed = state["step"], state["elapsed"]
        self.batches.rng.set_state(state["data_rng"])
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
            raise NonFiniteLoss(f"the weights hold NaN or inf after step {self.trainer.step} ({bad}); not saved, "
                                f"and {self.how_to_go_on()}")
        meta = {"config": dataclasses.asdict(self.cfg), "data_digest": self.corpus.digest}
        self.folder.save(self.trainer.step, self.args, state, meta, self.cfg.keep_checkpoints)

    def close(self, wait_for_all: bool = False) -> None:
        self.group.leave(wait_for_all)
        self.folder.close()
