"""K processes under torchrun: the process group, and the model replicated (DDP) or sharded (FSDP2).

On one process none of this does anything: world_size is 1, there is no group to join, and
the model is used as it is. Under `torchrun --nproc_per_node=K` every process reads its
RANK, LOCAL_RANK and WORLD_SIZE from the environment, joins one group (nccl on GPUs, gloo
on CPUs) and trains its slice of each global batch; the gradients are averaged (DDP) or
reduce-scattered into each process's shard (FSDP2, one fully_shard per block).
"""

import os
import sys
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn


class ProcessGroup:
    """This process's place among the K that torchrun started (one process: rank 0 of 1)."""

    def __init__(self):
        self.rank = int(os.environ.get("RANK", 0))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.is_main = self.rank == 0

    def join(self, device: torch.device) -> None:
        if self.world_size > 1 and not dist.is_initialized():
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    def leave(self, wait_for_all: bool = False) -> None:
        """Leave the group; after a normal end, only once every process got there (a process
        that tears down gloo while rank 0 still writes its checkpoint can abort it)."""
        if self.world_size > 1 and dist.is_initialized():
            if wait_for_all:
                dist.barrier()
            dist.destroy_process_group()

    @contextmanager
    def local_rank_zero_first(self):
        """Let local rank 0 build shared files (tokenizer, token cache) before the others read them."""
        if self.world_size > 1 and self.local_rank != 0:
            dist.barrier()
        yield
        if self.world_size > 1 and self.local_rank == 0:
            dist.barrier()

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor)  # gloo has no AVG: callers sum, then divide
        return tensor

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.sum(tensor) / self.world_size

    def any(self, flag: bool, device: torch.device) -> bool:
        """True where flag is true on any process: every process gets the same answer."""
        if self.world_size == 1:
            return flag
        return self.sum(torch.tensor([float(flag)], device=device)).item() > 0


def exit_process(code: int):
    """Exit with code; one of K processes without Python's shutdown. The threads of torch's gloo
    backend may still be dropping the tensors of the last collectives, which takes the
    interpreter's lock, and a thread that waits for it while Python shuts down aborts the whole
    process (about one run in 40 on 2 cores). The run's files are closed by then; its output is
    flushed here."""
    if ProcessGroup().world_size > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def wrap_model(raw_model: nn.Module, group: ProcessGroup, device: torch.device, fsdp: bool, compile: bool) -> nn.Module:
    """What a training step calls: raw_model replicated, or sharded in place; compiled in place, block by block."""
    model = raw_model
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (group.world_size,))
        for layer in model.layers:  # one all-gather per block: memory ~ 1/K of the weights
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if compile:
        # Each block compiled on its own (regional compilation, as torchtitan does): the blocks
        # share one compiled graph, so a cold compile costs about one block's worth, not the
        # whole model's, and the step runs as fast. The weights keep their names.
        for layer in raw_model.layers:
            layer.compile()
    if group.world_size > 1 and not fsdp:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


def gradient_sync(raw_model: nn.Module, model: nn.Module, sync: bool):
    """A context that skips the gradient all-reduce unless sync (the last micro-step of an accumulation)."""
    if hasattr(raw_model, "set_requires_gradient_sync"):  # sharded by FSDP2
        raw_model.set_requires_gradient_sync(sync)
    elif hasattr(model, "no_sync") and not sync:  # DDP
        return model.no_sync()
    return nullcontext()


def full_state_dicts(raw_model: nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool):
    """Model and optimizer state as plain, whole tensors; under FSDP gathered from the shards
    (a collective: every process must call it)."""
    if not fsdp:
        return raw_model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(raw_model, options=options), get_optimizer_state_dict(raw_model, optimizer, options=options)


def load_full_state_dicts(raw_model: nn.Module, optimizer, model_state: dict, optimizer_state, fsdp: bool) -> None:
    """The inverse of full_state_dicts: whole tensors in, each process keeps its shard.
    optimizer None loads the weights only (a fine-tuning run starts a fresh optimizer)."""
    if not fsdp:
        raw_model.load_state_dict(model_state)
        if optimizer is not None:
            optimizer.load_state_dict(optimizer_state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(raw_model, model_state, options=options)
    if optimizer is not None:
        set_optimizer_state_dict(raw_model, optimizer, optimizer_state, options=options)
