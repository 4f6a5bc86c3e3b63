"""A training run set up from its TrainConfig: start_run(cfg) -> a TrainingRun ready to step.

The run folder is checked first and taken last, so a run refused for a flag, a file or its
data leaves nothing behind. In between: the data and its tokenizer (a resumed run's own,
--tokenizer, the --init-from checkpoint's, or one trained on the data), the model (from
scratch, the run's latest checkpoint or --init-from; under --kernels auto with the fused
RMSNorm, SwiGLU gate and RoPE where they build, so that RMSNorm trains at LayerNorm's speed),
wrapped for the processes torchrun started, its optimizer and the Trainer that steps them.
"""

import functools
import sys

import torch

from ..support.device import pick_device
from ..formats.checkpoint import checkpoint_tokenizer, load_checkpoint
from ..kernels import flush_subnormals, use_fused_rmsnorm, use_fused_rope, use_fused_swiglu
from ..support.memory import check_free_memory, training_bytes
from ..model import Transformer
from ..quant import dequantize
from ..tokenizers import check_vocab_size, open_tokenizer
from ..trainer import Trainer, configure_optimizer
from .config import TrainConfig, finetune_config
from .data import TokenSplits, TrainBatches, load_tokenizer, open_corpus, tokenize
from .distributed import ProcessGroup, gradient_sync, load_full_state_dicts, wrap_model
from .folder import RunFolder
from .training_run import TrainingRun


def start_run(cfg: TrainConfig) -> TrainingRun:
    """The run cfg describes: new, resumed (--resume) or fine-tuning (--init-from)."""
    group = ProcessGroup()
    device = pick_device(cfg.device, group.local_rank)
    if cfg.fsdp and group.world_size == 1:
        raise ValueError("--fsdp shards the model across processes; launch with torchrun --nproc_per_node=K")
    if not (cfg.resume or cfg.init_from):  # the shape is the flags': checked before any file is written
        check_training_fits(cfg.model_args(cfg.vocab_size), cfg, device)
    folder = RunFolder(cfg.run_dir(), cfg.resume)
    saved = folder.read_state() if cfg.resume else None
    if saved is not None:
        cfg = folder.resumed_config(cfg, saved)
    if cfg.flush_denormals:
        flush_subnormals()
    group.join(device)
    try:
        run = _build(cfg, saved, folder, group, device)
        if group.is_main:
            folder.open(run.tokenizer.model_path)
    except BaseException:
        group.leave()
        raise
    return run


def _build(cfg: TrainConfig, saved, folder: RunFolder, group: ProcessGroup, device) -> TrainingRun:
    """Data, tokenizer, model, optimizer and Trainer, as a TrainingRun; restored from saved, or from --init-from."""
    corpus = open_corpus(cfg.data)  # checks the data before any work
    if saved and saved["data_digest"] != corpus.digest:
        raise ValueError(
            f"cannot --resume {folder.path}: it was trained on other data than "
            f"{cfg.data or 'the built-in stories'}; pass the --data it was trained on, or a new --out"
        )
    start = folder.latest or cfg.init_from
    source = load_checkpoint(start, dtype=torch.float32) if start else None
    if source:
        check_training_fits(source.args, cfg, device)
    if source and not saved:
        cfg = finetune_config(cfg, source.args)
        quantization = getattr(source, "quantization", None)
        if quantization:  # generate.py runs it, so it can be fine-tuned: from the weights it holds
            dequantize(source)
            if group.is_main:
                print(f"{start} holds {quantization['method']} weights: fine-tuning starts from them, "
                      "dequantized to float32 (not from the full-precision weights they were made from)", file=sys.stderr)
    tokenizer, tokens = _data(cfg, corpus, folder, group, source)
    args = source.args if source else cfg.model_args(tokenizer.n_words)
    torch.manual_seed(cfg.seed)  # the same seed on every process: every replica starts the same
    raw_model = Transformer(args).to(device)
    if cfg.kernels == "auto":
        use_fused_rope(use_fused_swiglu(use_fused_rmsnorm(raw_model)))
    model = wrap_model(raw_model, group, device, cfg.fsdp, cfg.compile)
    hp = cfg.hyperparameters()
    optimizer = configure_optimizer(raw_model, hp, device, sharded=cfg.fsdp)
    batches = TrainBatches(tokens, cfg.batch_size, cfg.seq_len, device, cfg.seed, group.rank, group.world_size)
    # On one process a step runs no code of distributed.py: the Trainer's defaults do nothing.
    processes = {} if group.world_size == 1 else {
        "gradient_sync": functools.partial(gradient_sync, raw_model, model), "average": group.mean}
    trainer = Trainer(model, optimizer, hp, batches, bf16=trains_in_bf16(cfg, device), **processes)
    run = TrainingRun(cfg, trainer, raw_model, batches, tokens, tokenizer, corpus, folder, group, device)
    if saved:
        run.load_state_dict({**saved, "model": source.state_dict()})
    elif source:  # fine-tuning: the weights, and a fresh optimizer
        load_full_state_dicts(raw_model, None, source.state_dict(), None, cfg.fsdp)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores: free speed
    return run


def trains_in_bf16(cfg: TrainConfig, device) -> bool:
    """--dtype bfloat16, or auto on a GPU with fast bfloat16: the forward runs under bfloat16 autocast."""
    return cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())


def check_training_fits(args, cfg: TrainConfig, device) -> None:
    """Refuse, in one line, a model and batch whose training cannot fit the device's free memory."""
    n = args.n_parameters
    model = f"{n / 1e6:,.2f}M" if n < 1e15 else f"{n:.1e}"
    fix = "lower --batch-size" + ("" if cfg.init_from or cfg.resume else ", --dim or --n-layers")
    check_free_memory(training_bytes(args, cfg.batch_size, cfg.seq_len),
               f"training {model} parameters on batches of {cfg.batch_size} x {cfg.seq_len} tokens", device, fix)


def _data(cfg: TrainConfig, corpus, folder: RunFolder, group: ProcessGroup, source=None):
    """The tokenizer and the token splits. The first process on each machine builds the
    caches; the others wait, then read them. A checkpoint's tokenizer must have its vocabulary
    (source: the model a run starts from), checked before the data is tokenized with it."""
    if folder.latest:  # a resumed run's own copy
        path = checkpoint_tokenizer(folder.latest)
    elif cfg.init_from:
        path = checkpoint_tokenizer(cfg.init_from, cfg.tokenizer)
    else:
        path = cfg.tokenizer  # None: one is trained on the data
    with group.local_rank_zero_first():
        tokenizer = open_tokenizer(path) if path else load_tokenizer(corpus, cfg.vocab_size, cfg.cache_dir)
        if source is not None:
            check_vocab_size(tokenizer, source.args.vocab_size, folder.latest or cfg.init_from)
        tokens = TokenSplits(tokenize(corpus, tokenizer, cfg.cache_dir), cfg.val_fraction)
    tokens.check_seq_len(cfg.seq_len, corpus.name)
    prompt_len = len(tokenizer.encode(cfg.prompt))
    if cfg.sample_tokens and prompt_len >= cfg.seq_len:  # found out now, not after the training
        raise ValueError(f"--prompt is {prompt_len} tokens but the context (--seq-len) is {cfg.seq_len}; shorten it")
    return tokenizer, tokens
