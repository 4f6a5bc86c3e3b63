"""Training a small Llama from scratch: TrainConfig, Trainer, train().

TrainConfig holds one field per train.py flag. Trainer owns everything one run needs
(tokenizer, token windows, model, optimizer, the data sampler's RNG) and takes one
optimizer step at a time, so other code (the norm ablation) can drive it. train() is the
loop around it: progress bar, evaluation, metrics log, checkpoints, resume, Ctrl-C.

Exact resume is the design constraint that shapes the rest. Everything a step depends on
is either a function of the step number (the learning rate), saved in the checkpoint (the
weights, AdamW's moments, every RNG state) or kept out of the training RNG's way
(evaluation reads fixed windows). A run killed at any moment and resumed therefore ends
with bitwise the same weights as one that never stopped.
"""

import dataclasses
import json
import math
import os
import random
import shutil
import signal
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from .checkpoint import LATEST, TOKENIZER, build_model, load_checkpoint, save_checkpoint
from .data import TokenSplits, corpus_name, load_tokenizer, open_corpus, tokenize
from .device import pick_device
from .files import atomic_write, fsync_dir
from .generation import generate
from .model import ModelArgs, Transformer
from .run_lock import RunLock
from .tokenizer import Tokenizer

TRAIN_STATE = "train_state.pt"
METRICS = "metrics.jsonl"
DTYPES = ("auto", "float32", "bfloat16")


@dataclass
class TrainConfig:
    """One field per train.py flag (--max-steps is max_steps). The defaults train a
    ~2M-parameter model on the built-in stories in about five minutes on two CPU cores."""

    data: Optional[str] = None  # a UTF-8 .txt file or a folder of them; None: the built-in stories
    out: Optional[str] = None  # the run folder; None: checkpoints/<run-name>
    run_name: Optional[str] = None  # None: the data's name ("stories" for the built-in corpus)
    cache_dir: str = "tokenizer"  # trained tokenizers and token caches
    tokenizer: Optional[str] = None  # an existing tokenizer.model instead of training one
    vocab_size: int = 2048  # of the tokenizer trained on the data; 2048 makes every name in the stories one token
    val_fraction: float = 0.1
    # model
    dim: int = 192
    n_layers: int = 4
    n_heads: int = 6
    n_kv_heads: Optional[int] = None
    norm: str = "rmsnorm"
    norm_p: float = 0.0625  # only used by prmsnorm: the fraction of the vector its RMS reads
    tie_embeddings: bool = True  # output layer = input embedding, as in llama2.c and Llama-3.2 1B
    # optimisation
    max_steps: int = 600
    batch_size: int = 16  # sequences per micro-step per process
    seq_len: int = 256
    grad_accum: int = 1
    lr: float = 4e-3
    min_lr: Optional[float] = None  # end of the cosine; None: lr / 10
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    seed: int = 1337
    # bookkeeping
    resume: bool = False
    save_every: int = 200
    keep_checkpoints: int = 2
    eval_every: int = 100
    eval_iters: int = 10  # batches per evaluation
    sample_tokens: int = 200
    prompt: str = "Once upon a time"
    # hardware
    device: Optional[str] = None  # None: cuda, then mps, then cpu
    dtype: str = "auto"  # auto: bfloat16 autocast on CUDA, float32 elsewhere
    compile: bool = False
    fsdp: bool = False  # shard parameters, gradients and optimizer state (FSDP2) under torchrun

    def __post_init__(self):
        positive = ("max_steps", "batch_size", "seq_len", "grad_accum", "dim", "n_layers", "n_heads", "vocab_size",
                    "save_every", "eval_every", "eval_iters", "keep_checkpoints")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{flag(name)} must be a positive integer, got {getattr(self, name)}")
        for name in ("warmup_steps", "weight_decay", "grad_clip", "sample_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.n_kv_heads is not None and self.n_kv_heads <= 0:
            raise ValueError(f"--n-kv-heads must be a positive integer, got {self.n_kv_heads}")
        if not self.lr > 0 or (self.min_lr is not None and not 0 <= self.min_lr <= self.lr):
            raise ValueError(f"need 0 < --lr and 0 <= --min-lr <= --lr, got lr {self.lr}, min_lr {self.min_lr}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be between 0 and 1, got {self.val_fraction}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        self.model_args(vocab_size=self.vocab_size)  # shape errors (dim vs heads, unknown norm) now, not later

    def model_args(self, vocab_size: int) -> ModelArgs:
        return ModelArgs(
            dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
            vocab_size=vocab_size, max_seq_len=self.seq_len, norm=self.norm, norm_p=self.norm_p,
            tie_embeddings=self.tie_embeddings,
        )

    def run_dir(self) -> Path:
        return Path(self.out) if self.out else Path("checkpoints") / (self.run_name or corpus_name(self.data))


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


# Settings a resumed run must share with its checkpoint: they fix the model and the data it
# sees (and under --fsdp, the optimizer state is keyed by parameter name, not position).
RESUME_MUST_MATCH = (
    "dim", "n_layers", "n_heads", "n_kv_heads", "norm", "norm_p", "tie_embeddings",
    "vocab_size", "tokenizer", "seq_len", "val_fraction", "fsdp",
)


class NonFiniteLoss(ValueError):
    """The loss or the gradient became NaN or infinite; the weights were not updated."""


# --- Pieces with one job each -----------------------------------------------------------------


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
    """prompt and the model's continuation, which stops early at an end of text (EOS)."""
    ids = tokenizer.encode(prompt, bos=True)
    max_new_tokens = max(0, min(max_new_tokens, model.args.max_seq_len - len(ids)))
    try:
        new = generate(model, [ids], max_new_tokens, temperature=0.6, top_p=0.9, eos_id=tokenizer.eos_id, seed=seed)[0]
    finally:
        for layer in model.layers:  # drop the KV cache: it is only needed while sampling
            layer.attention.cache = None
    return tokenizer.decode(ids + new)


# --- The trainer ------------------------------------------------------------------------------


class Trainer:
    """Builds tokenizer, data, model and optimizer for cfg; resumes from cfg.run_dir() with
    cfg.resume. Under torchrun it joins the process group and wraps the model in DDP (or
    shards it with FSDP2 when cfg.fsdp)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.rank = int(os.environ.get("RANK", 0))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.is_main = self.rank == 0
        self.device = pick_device(cfg.device, self.local_rank)
        self.run_dir = cfg.run_dir()
        self.latest = self.find_resume_checkpoint()  # before any heavy work: flag errors come first
        saved = self.read_train_state(self.latest) if self.latest else None
        if cfg.fsdp and self.world_size == 1:
            raise ValueError("--fsdp shards the model across processes; launch with torchrun --nproc_per_node=K")
        if self.world_size > 1 and not dist.is_initialized():
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")

        self.corpus = open_corpus(cfg.data)  # checks the data before anything is written
        if saved and saved["data_digest"] != self.corpus.digest:
            raise ValueError(
                f"cannot --resume {self.run_dir}: it was trained on other data than "
                f"{cfg.data or 'the built-in stories'}; pass the --data it was trained on, or a new --out"
            )
        self.lock = RunLock(self.run_dir).acquire() if self.is_main else None  # one writer per run folder
        try:
            self.build(saved)
        except BaseException:
            self.close()
            raise

    def build(self, saved: Optional[dict]) -> None:
        """Tokenizer, token splits, model and optimizer, restored from saved when resuming."""
        cfg = self.cfg
        self.tokenizer, self.tokens = self.prepare_data()
        # The same seed on every process gives every replica the same initial weights.
        torch.manual_seed(cfg.seed)
        self.args = cfg.model_args(self.tokenizer.n_words)
        self.model = Transformer(self.args).to(self.device)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.data_rng = torch.Generator().manual_seed(cfg.seed)
        self.step, self.elapsed = 0, 0.0
        if saved:
            self.model.load_state_dict(load_checkpoint(self.latest).state_dict())
        self.engine = self.wrap_model()
        self.optimizer = configure_optimizer(self.model, cfg, self.device)
        if saved:
            self.restore(saved)
        cuda_bf16 = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        self.bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and cuda_bf16)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores: free speed
        self.stop_requested = False
        if self.is_main:
            # The run's own copy of its tokenizer, which every checkpoint copies: the file it
            # was loaded from may be a checkpoint that gets pruned, or a cache someone clears.
            atomic_write(self.run_dir / TOKENIZER, lambda tmp: shutil.copyfile(self.tokenizer.model_path, tmp))

    # -- setup helpers --

    def find_resume_checkpoint(self) -> Optional[Path]:
        latest = self.run_dir / LATEST
        if not self.cfg.resume:
            if latest.is_file():
                raise ValueError(
                    f"{self.run_dir} already holds a training run; "
                    "pass --resume to continue it, or --out DIR for a new run"
                )
            return None
        if not latest.is_file():
            raise ValueError(
                f"nothing to resume: {self.run_dir} holds no checkpoint ({LATEST} is missing); "
                "run without --resume to start"
            )
        return self.run_dir / latest.read_text().strip()

    def read_train_state(self, folder: Path) -> dict:
        """The training state of a checkpoint, checked against cfg before anything is built."""
        try:
            state = torch.load(folder / TRAIN_STATE, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise ValueError(f"cannot --resume: {folder / TRAIN_STATE} is missing; not a training checkpoint") from None
        except Exception as e:  # a torn or foreign file: refuse it by name
            raise ValueError(f"cannot --resume: {folder / TRAIN_STATE} is corrupt ({type(e).__name__})") from None
        old = state["config"]
        now = dataclasses.asdict(self.cfg)
        diffs = [f"{flag(k)} {old.get(k)} (now {now[k]})" for k in RESUME_MUST_MATCH if old.get(k) != now[k]]
        if diffs:
            raise ValueError(
                f"cannot --resume {self.run_dir}: it was trained with {', '.join(diffs)}; "
                "pass the flags it was trained with, or a new --out to start another run"
            )
        return state

    def prepare_data(self):
        """The tokenizer (a resumed run's own) and the token splits of the corpus. The first
        process on each machine builds the caches; the others wait, then read them."""
        cfg, corpus = self.cfg, self.corpus
        with self.local_rank_zero_first():
            if self.latest:
                tokenizer = Tokenizer(self.latest / TOKENIZER)
            elif cfg.tokenizer:
                tokenizer = Tokenizer(cfg.tokenizer)
            else:
                tokenizer = load_tokenizer(corpus, cfg.vocab_size, cfg.cache_dir)
            tokens = TokenSplits(tokenize(corpus, tokenizer, cfg.cache_dir), cfg.val_fraction)
        tokens.check_seq_len(cfg.seq_len, corpus.name)
        return tokenizer, tokens

    @contextmanager
    def local_rank_zero_first(self):
        """Let local rank 0 build shared files (tokenizer, token cache) before the others read them."""
        if self.world_size > 1 and self.local_rank != 0:
            dist.barrier()
        yield
        if self.world_size > 1 and self.local_rank == 0:
            dist.barrier()

    def wrap_model(self) -> torch.nn.Module:
        """What a training step calls: the model, compiled and/or replicated or sharded."""
        model = self.model
        if self.cfg.fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(self.device.type, (self.world_size,))
            for layer in model.layers:  # one all-gather per block: memory ~ 1/K of the weights
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        if self.cfg.compile:
            model = torch.compile(model)
        self.compiled = model
        if self.world_size > 1 and not self.cfg.fsdp:
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.device.index] if self.device.type == "cuda" else None
            model = DistributedDataParallel(model, device_ids=device_ids)
        return model

    # -- one step --

    def batch(self):
        """This process's share of the next global batch. Every process draws the same
        batch_size * world_size offsets from the same RNG and keeps its slice, so K
        processes see exactly the windows one process would with the whole batch."""
        B, T = self.cfg.batch_size, self.cfg.seq_len
        starts = self.tokens.random_starts("train", B * self.world_size, T, self.data_rng)
        x, y = self.tokens.windows("train", starts[self.rank * B : (self.rank + 1) * B], T)
        if self.device.type == "cuda":  # from pinned memory the copy overlaps with the GPU's work
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else nullcontext()

    def loss(self, model, x, y) -> torch.Tensor:
        with self.autocast():
            logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def sync_gradients(self, sync: bool):
        """Skip the gradient all-reduce on all but the last micro-step of an accumulation."""
        if self.cfg.fsdp:
            self.model.set_requires_gradient_sync(sync)
            return nullcontext()
        if self.world_size > 1 and not sync:
            return self.engine.no_sync()
        return nullcontext()

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
            with self.sync_gradients(micro == cfg.grad_accum - 1):
                loss = self.loss(self.engine, x, y) / cfg.grad_accum
                loss.backward()
            total += loss.detach()
        if self.world_size > 1:
            dist.all_reduce(total)  # gloo has no AVG: sum, then divide
            total /= self.world_size
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip or math.inf)
        if hasattr(norm, "full_tensor"):  # FSDP: a DTensor
            norm = norm.full_tensor()
        loss, norm = torch.stack([total, norm.to(total)]).tolist()
        if not (math.isfinite(loss) and math.isfinite(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            what, value = ("loss", loss) if not math.isfinite(loss) else ("gradient norm", norm)
            last = f"the last good checkpoint is {self.latest}" if self.latest else "no checkpoint was saved yet"
            raise NonFiniteLoss(
                f"{what} is {value} at step {self.step + 1}; stopped before updating the weights, and {last}. "
                "Lower --lr (or raise --warmup-steps) and --resume"
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.last_lr, self.last_grad_norm = lr, norm
        return loss

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean loss and perplexity on the same eval_iters * batch_size windows of the
        validation split every time, spread evenly over it; shared out among processes."""
        B, T = self.cfg.batch_size, self.cfg.seq_len
        starts = self.tokens.even_starts("val", self.cfg.eval_iters * B * self.world_size, T)
        starts = starts.view(self.world_size, -1)[self.rank]
        model = self.compiled  # not the DDP wrapper: evaluation needs no gradient sync
        model.eval()
        total = torch.zeros((), device=self.device)
        for chunk in starts.split(B):
            x, y = self.tokens.windows("val", chunk, T)
            total += self.loss(model, x.to(self.device), y.to(self.device)) * len(chunk)
        model.train()
        if self.world_size > 1:
            dist.all_reduce(total)
        val_loss = total.item() / len(starts) / self.world_size
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700))}

    def sample(self, prompt: str, max_new_tokens: int) -> str:
        """The model's continuation of prompt (temperature 0.6, top-p 0.9, seeded by cfg.seed)."""
        if self.cfg.fsdp:
            raise ValueError("a sharded (--fsdp) model cannot sample in place; sample load_checkpoint(run folder)")
        self.model.eval()
        try:
            return sample_text(self.model, self.tokenizer, prompt, max_new_tokens, seed=self.cfg.seed)
        finally:
            self.model.train()

    # -- checkpoints --

    def full_state(self):
        """Model and optimizer state as plain, whole tensors (gathered from the shards under FSDP)."""
        if not self.cfg.fsdp:
            return self.model.state_dict(), self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(self.model, options=options)
        return model_state, get_optimizer_state_dict(self.model, self.optimizer, options=options)

    def save(self) -> Path:
        """Write step-NNNNNN/ (weights, config, tokenizer, training state) under a temporary
        name, rename it into place, then point `latest` at it. A crash at any moment leaves
        `latest` naming a complete checkpoint. Keeps the newest keep_checkpoints."""
        model_state, optim_state = self.full_state()  # collective under FSDP: every rank calls it
        folder = self.run_dir / f"step-{self.step:06d}"
        if self.is_main:
            tmp = self.run_dir / f".tmp-{folder.name}"
            shutil.rmtree(tmp, ignore_errors=True)
            state = {
                "step": self.step, "elapsed": self.elapsed, "optimizer": optim_state,
                "data_rng": self.data_rng.get_state(), "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                "python_rng": random.getstate(), "config": dataclasses.asdict(self.cfg),
                "data_digest": self.corpus.digest,
            }
            try:
                save_checkpoint(build_model(self.args, model_state), tmp, tokenizer_path=self.run_dir / TOKENIZER)
                atomic_write(tmp / TRAIN_STATE, lambda path: torch.save(state, path))
            except BaseException:  # a full disk, say: leave no half-written folder behind
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            shutil.rmtree(folder, ignore_errors=True)  # a leftover from a run killed after this point
            os.replace(tmp, folder)
            fsync_dir(self.run_dir)
            atomic_write(self.run_dir / LATEST, lambda path: path.write_text(folder.name + "\n"))
            for old in sorted(self.run_dir.glob("step-*"))[: -self.cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        self.latest = folder
        return folder

    def restore(self, state: dict) -> None:
        """Continue exactly where the checkpoint stopped (the weights are already loaded)."""
        if self.cfg.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            options = StateDictOptions(full_state_dict=True)
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.elapsed = state["step"], state["elapsed"]
        self.data_rng.set_state(state["data_rng"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        random.setstate(state["python_rng"])

    # -- stopping --

    def should_stop(self) -> bool:
        """True once Ctrl-C (or SIGTERM) reached any process; all processes agree on it."""
        if self.world_size == 1:
            return self.stop_requested
        flag_ = torch.tensor([float(self.stop_requested)], device=self.device)
        dist.all_reduce(flag_)
        return flag_.item() > 0

    @contextmanager
    def graceful_stop(self):
        """Turn Ctrl-C and SIGTERM (torchrun's and schedulers' way to stop) into a request to
        stop after the current step, so the checkpoint saved then is consistent. A second
        Ctrl-C interrupts at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self.stop_requested:
                raise KeyboardInterrupt
            self.stop_requested = True

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def close(self, wait_for_all: bool = False) -> None:
        """Leave the process group; after a normal end, only once every process got there (a
        process that tears down gloo while rank 0 still writes its checkpoint can abort)."""
        if self.world_size > 1 and dist.is_initialized():
            if wait_for_all:
                dist.barrier()
            dist.destroy_process_group()
        if self.lock:
            self.lock.release()


# --- The loop ---------------------------------------------------------------------------------


class MetricsLog:
    """<run>/metrics.jsonl, one JSON object per step. On resume the records past the
    checkpoint's step (written before a crash) are dropped, so the log tells one history."""

    def __init__(self, path: Path, step: int):
        self.path = path
        kept = [r for r in read_metrics(path) if r["step"] <= step] if step else []
        atomic_write(path, lambda tmp: tmp.write_text("".join(json.dumps(r) + "\n" for r in kept)))
        self.file = open(path, "a")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read_metrics(path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def report_losses(run_dir: Path) -> None:
    """loss.png in the run folder when matplotlib is installed; a table of evaluations otherwise."""
    records = read_metrics(run_dir / METRICS)
    evals = [r for r in records if "val_loss" in r]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("step   train loss   val loss   val ppl   (pip install matplotlib for loss.png)")
        train = {r["step"]: r["train_loss"] for r in records if "train_loss" in r}
        for r in evals:
            train_loss = train.get(r["step"], float("nan"))
            print(f"{r['step']:>5}   {train_loss:>10.4f}   {r['val_loss']:>8.4f}   {r['val_ppl']:>7.2f}")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    trained = [r for r in records if "train_loss" in r]
    ax.plot([r["step"] for r in trained], [r["train_loss"] for r in trained], lw=0.8, alpha=0.6, label="train")
    ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="val")
    ax.set(xlabel="step", ylabel="cross-entropy loss (nats per token)", yscale="log", title=run_dir.name)
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=120)
    plt.close(fig)
    print(f"loss curve: {run_dir / 'loss.png'}")


def train(cfg: TrainConfig) -> Path:
    """Train (or resume) the run described by cfg; returns its run folder.

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
    return trainer.run_dir


def run(trainer: Trainer) -> None:
    cfg, main = trainer.cfg, trainer.is_main
    run_dir = trainer.run_dir
    prompt_len = len(trainer.tokenizer.encode(cfg.prompt))
    if cfg.sample_tokens and prompt_len >= cfg.seq_len:  # found out now, not after the training
        raise ValueError(f"--prompt is {prompt_len} tokens but the context (--seq-len) is {cfg.seq_len}; shorten it")
    if main:
        for stale in run_dir.glob(".tmp-step-*"):  # a checkpoint a crash left half-written
            shutil.rmtree(stale, ignore_errors=True)
        log = MetricsLog(run_dir / METRICS, trainer.step)
        n_train = len(trainer.tokens.splits["train"])
        print(
            f"{trainer.n_params / 1e6:.2f}M parameters (dim {cfg.dim}, {cfg.n_layers} layers, "
            f"vocab {trainer.args.vocab_size}); "
            f"{n_train / 1e6:.2f}M training tokens; {trainer.device} {'bfloat16' if trainer.bf16 else 'float32'}"
            f"{f' x {trainer.world_size} processes' if trainer.world_size > 1 else ''}; run folder {run_dir}"
            + (f"; resuming at step {trainer.step}" if trainer.step else "")
        )
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * trainer.world_size
    bar = tqdm(total=cfg.max_steps, initial=trainer.step, disable=not main, unit="step", dynamic_ncols=True)
    try:
        with trainer.graceful_stop():
            if trainer.step == 0:
                first = trainer.evaluate()
                if main:
                    log.write({"step": 0, "time": 0.0, **first})
            tick = time.perf_counter()
            while trainer.step < cfg.max_steps:
                loss = trainer.train_step()
                dt = time.perf_counter() - tick
                trainer.elapsed += dt
                record = {
                    "step": trainer.step, "time": round(trainer.elapsed, 3), "train_loss": loss, "lr": trainer.last_lr,
                    "grad_norm": trainer.last_grad_norm, "tokens_per_s": round(tokens_per_step / dt, 1),
                }
                postfix = dict(loss=f"{loss:.3f}", lr=f"{trainer.last_lr:.2e}", tok_s=f"{record['tokens_per_s']:,.0f}")
                bar.set_postfix(postfix, refresh=False)
                bar.update()
                done = trainer.step == cfg.max_steps
                if trainer.step % cfg.eval_every == 0 or done:
                    record.update(trainer.evaluate())
                    if main:
                        val = f"val loss {record['val_loss']:.4f}, perplexity {record['val_ppl']:.2f}"
                        bar.write(f"step {trainer.step}: {val}")
                if main:
                    log.write(record)
                stop = trainer.should_stop()
                if trainer.step % cfg.save_every == 0 or done or stop:
                    trainer.save()
                if stop:
                    raise KeyboardInterrupt
                tick = time.perf_counter()  # evaluation and saving are not training time
    except KeyboardInterrupt:
        bar.close()
        if main:
            latest = f"the latest checkpoint is {trainer.latest}" if trainer.latest else "no checkpoint was saved"
            print(f"interrupted at step {trainer.step}; {latest}; continue with the same flags and --resume")
        raise
    finally:
        bar.close()
        if main:
            log.close()
    if main:
        report_losses(run_dir)
    if main and cfg.sample_tokens:
        model = load_checkpoint(run_dir).to(trainer.device)  # the saved model, as a user would load it
        text = sample_text(model, trainer.tokenizer, cfg.prompt, cfg.sample_tokens, seed=cfg.seed)
        print(f"\nsample from {trainer.latest}:\n{text}\n")
