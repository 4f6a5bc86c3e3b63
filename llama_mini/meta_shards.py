"""Meta's model-parallel checkpoints: one consolidated.NN.pth per rank, merged and split.

Meta's 13B ships as 2 files and its 70B as 8, each holding every rank's slice of each matrix;
loading merges them into one state dict, and convert --shards splits one the same way.
"""

import torch

# Meta's model-parallel layers: ColumnParallelLinear splits its output features (dim 0),
# RowParallelLinear and ParallelEmbedding split their input / embedding features (dim 1).
# 1-D tensors (the norm weights) are replicated on every rank.
_META_SHARD_DIM = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "wo": 1, "w2": 1, "tok_embeddings": 1}


def merge_meta_shards(shards: list[dict]) -> dict:
    """Meta's model-parallel shards -> one state dict; rope.freqs is dropped (we recompute it).

    A single shard is returned as it is, so its memory-mapped tensors are never copied.
    """
    for rank, shard in enumerate(shards[1:], start=1):
        if shard.keys() != shards[0].keys():
            extra = sorted(shard.keys() ^ shards[0].keys())[:3]
            raise ValueError(f"model-parallel shards 00 and {rank:02d} hold different tensors ({extra}); download them again")
    merged = {}
    for key, first in shards[0].items():
        if key == "rope.freqs":
            continue
        parts = [shard[key] for shard in shards]
        if len(shards) > 1 and any(p.shape != first.shape for p in parts):
            shapes = ", ".join(str(tuple(p.shape)) for p in parts)
            raise ValueError(f"tensor {key} has different shapes in the model-parallel shards ({shapes}); download them again")
        if len(shards) == 1 or first.dim() == 1:
            merged[key] = first
        elif first.dim() == 2:
            merged[key] = torch.cat(parts, dim=_meta_shard_dim(key))
        else:
            raise ValueError(f"tensor {key} has {first.dim()} dimensions; a Meta Llama checkpoint holds matrices and vectors")
    return merged


def split_meta_shards(state: dict, n: int) -> list[dict]:
    """Inverse of merge_meta_shards: the state dict of each of n model-parallel ranks."""
    return [
        {key: (t if t.dim() == 1 else t.chunk(n, dim=_meta_shard_dim(key))[rank]).clone() for key, t in state.items()}
        for rank in range(n)
    ]


def _meta_shard_dim(key: str) -> int:
    name = key.split(".")[-2]  # layers.0.attention.wq.weight -> wq; output.weight -> output
    if name not in _META_SHARD_DIM:
        raise ValueError(f"tensor {key} is not part of a Meta Llama checkpoint")
    return _META_SHARD_DIM[name]
