"""Hugging Face's Llama layout: parameter names, the q/k row permutation, config.json fields.

Everything that differs between Meta's layout (ours) and transformers' LlamaForCausalLM
lives here, each fact once, with its inverse beside it.
"""

import re

from .model import ModelArgs

# Ours (Meta's) -> Hugging Face's, per layer and for the rest.
_LAYER_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"(model\.)?layers\.(\d+)\.(.+)")


def permute_to_hf(w, n_heads: int):
    """Meta's rotary pairs are adjacent rows (0,1), (2,3), ... of each head; HF's
    rotate_half pairs row i with row i + head_dim/2. HF's converter therefore reorders
    the rows of wq and wk so that the same rotation lands on the same numbers."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_from_hf(w, n_heads: int):
    """Inverse of permute_to_hf."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _rename_key(key: str, table_layer: dict, table_top: dict, hf_prefix: str):
    if key in table_top:
        return table_top[key]
    m = _LAYER_RE.fullmatch(key)
    if m and m.group(3) in table_layer:
        return f"{hf_prefix}layers.{m.group(2)}.{table_layer[m.group(3)]}"
    raise KeyError(key)


def to_hf_state_dict(state_dict: dict, args: ModelArgs) -> dict:
    """Our state dict -> transformers' LlamaForCausalLM state dict (q/k rows permuted)."""
    out = {}
    for key, w in state_dict.items():
        if key == "output.weight" and args.tie_embeddings:
            continue  # HF stores a tied head once, as the embedding
        if key.endswith("attention.wq.weight"):
            w = permute_to_hf(w, args.n_heads)
        elif key.endswith("attention.wk.weight"):
            w = permute_to_hf(w, args.n_kv_heads)
        out[_rename_key(key, _LAYER_KEYS, _TOP_KEYS, "model.")] = w
    return out


def from_hf_state_dict(state_dict: dict, args: ModelArgs) -> dict:
    """transformers' LlamaForCausalLM state dict -> ours (q/k rows restored to Meta's order)."""
    layer_back = {v: k for k, v in _LAYER_KEYS.items()}
    top_back = {v: k for k, v in _TOP_KEYS.items()}
    out = {}
    for key, w in state_dict.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue  # old transformers saved this buffer; we recompute it
        ours = _rename_key(key, layer_back, top_back, "")
        if ours.endswith("attention.wq.weight"):
            w = permute_from_hf(w, args.n_heads)
        elif ours.endswith("attention.wk.weight"):
            w = permute_from_hf(w, args.n_kv_heads)
        out[ours] = w
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


# HF's llama3 rope_scaling keys -> our ModelArgs fields.
_LLAMA3_ROPE_KEYS = {
    "factor": "rope_scaling_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_max_seq_len",
}


def rope_args_from_hf_config(config: dict, source="config.json") -> dict:
    """The RoPE fields of ModelArgs from config.json: rope_parameters (transformers >= 5) or
    rope_scaling and rope_theta (earlier versions).

    A rope_type we do not implement (yarn, dynamic, longrope, linear, ...) is refused: loaded
    with plain RoPE, such a model would run and be wrong.
    """
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{source}: rope_scaling (rope_parameters) must be a JSON object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    fields = {"rope_theta": rope.get("rope_theta", config.get("rope_theta", 10000.0))}
    if rope_type == "default":
        return fields
    if rope_type != "llama3":
        raise ValueError(f"{source} asks for rope_type {rope_type!r}, which llama_mini does not implement (it has default and llama3)")
    missing = [key for key in _LLAMA3_ROPE_KEYS if rope.get(key) is None]
    if missing:
        raise ValueError(f"{source}: rope_type 'llama3' lacks {', '.join(missing)}; the model's published config.json states them")
    return {**fields, "use_scaled_rope": True, **{ours: rope[key] for key, ours in _LLAMA3_ROPE_KEYS.items()}}


def args_from_hf_config(config: dict, source="config.json") -> ModelArgs:
    """config.json of a Llama model -> ModelArgs. source names the file in error messages."""
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or dim // n_heads
    if head_dim != dim // n_heads:
        raise ValueError(f"{source}: head_dim {head_dim} != hidden_size / num_attention_heads; not a Llama layout")
    rope = rope_args_from_hf_config(config, source)
    try:
        return ModelArgs(
            dim=dim,
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            vocab_size=config["vocab_size"],
            hidden_dim=config["intermediate_size"],
            norm_eps=config.get("rms_norm_eps", 1e-6),
            max_seq_len=config.get("max_position_embeddings", 4096),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            **rope,
        )
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def hf_config_from_args(args: ModelArgs) -> dict:
    """ModelArgs -> the config.json fields of transformers' LlamaConfig."""
    if args.norm != "rmsnorm":
        raise ValueError(f"transformers' Llama has RMSNorm only; this model uses {args.norm!r}")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
    }
    if args.use_scaled_rope:  # the key every transformers version reads (>= 5 converts it)
        config["rope_scaling"] = {"rope_type": "llama3", **{key: getattr(args, ours) for key, ours in _LLAMA3_ROPE_KEYS.items()}}
    return config
