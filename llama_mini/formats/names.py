"""Parameter names: ours (Meta's, model.py's) and each foreign layout's, in one table with its inverse.

Meta's files use our names, so they need no renaming; Meta's model-parallel checkpoints split
each matrix along the dimension given here (13B: 2 files, 70B: 8). Hugging Face's
LlamaForCausalLM and llama.cpp's GGUF files name the same tensors their own way. Every reader
and writer of those formats renames through to_format and from_format, as torchtitan's
state-dict adapters do.
"""

import re

# Per block, inside layers.N. (ours), model.layers.N. (Hugging Face) and blk.N. (GGUF); then
# the dimension Meta's model-parallel layers split: ColumnParallelLinear its output features (0),
# RowParallelLinear its input features (1); norms are replicated (None).
BLOCK_NAMES = [
    # ours                      Hugging Face                        GGUF                   Meta split
    ("attention_norm.weight",   "input_layernorm.weight",           "attn_norm.weight",    None),
    ("attention.wq.weight",     "self_attn.q_proj.weight",          "attn_q.weight",       0),
    ("attention.wk.weight",     "self_attn.k_proj.weight",          "attn_k.weight",       0),
    ("attention.wv.weight",     "self_attn.v_proj.weight",          "attn_v.weight",       0),
    ("attention.wo.weight",     "self_attn.o_proj.weight",          "attn_output.weight",  1),
    ("ffn_norm.weight",         "post_attention_layernorm.weight",  "ffn_norm.weight",     None),
    ("feed_forward.w1.weight",  "mlp.gate_proj.weight",             "ffn_gate.weight",     0),
    ("feed_forward.w2.weight",  "mlp.down_proj.weight",             "ffn_down.weight",     1),
    ("feed_forward.w3.weight",  "mlp.up_proj.weight",               "ffn_up.weight",       0),
]
MODEL_NAMES = [
    ("tok_embeddings.weight",   "model.embed_tokens.weight",        "token_embd.weight",   1),  # ParallelEmbedding
    ("norm.weight",             "model.norm.weight",                "output_norm.weight",  None),
    ("output.weight",           "lm_head.weight",                   "output.weight",       0),
]
_COLUMN = {"ours": 0, "hf": 1, "gguf": 2}
BLOCK_PREFIX = {"ours": "layers.", "hf": "model.layers.", "gguf": "blk."}
_BLOCK_NAME = {"ours": re.compile(r"layers\.(\d+)\.(.+)"), "hf": re.compile(r"(?:model\.)?layers\.(\d+)\.(.+)"),
               "gguf": re.compile(r"blk\.(\d+)\.(.+)")}


def _find(name: str, layout: str):
    """(the table's row, the block number or None) of a parameter called name in layout ("ours",
    "hf" or "gguf"); KeyError if it is not a parameter of a Llama model."""
    column = _COLUMN[layout]
    for row in MODEL_NAMES:
        if row[column] == name:
            return row, None
    m = _BLOCK_NAME[layout].fullmatch(name)
    for row in BLOCK_NAMES if m else ():
        if row[column] == m.group(2):
            return row, m.group(1)
    raise KeyError(name)


def rename(name: str, source: str, target: str) -> str:
    """A parameter's name in layout source -> its name in layout target."""
    row, block = _find(name, source)
    theirs = row[_COLUMN[target]]
    return theirs if block is None else f"{BLOCK_PREFIX[target]}{block}.{theirs}"


def to_format(name: str, fmt: str) -> str:
    """Our parameter name -> its name in fmt ("hf" or "gguf")."""
    return rename(name, "ours", fmt)


def from_format(name: str, fmt: str) -> str:
    """A parameter name in fmt ("hf" or "gguf") -> ours; KeyError if it is not a Llama parameter."""
    return rename(name, fmt, "ours")


def meta_split_dim(name: str):
    """The dimension Meta's model-parallel files split our parameter `name` along (None: every
    file holds all of it); KeyError if it is not a Llama parameter."""
    return _find(name, "ours")[0][3]
