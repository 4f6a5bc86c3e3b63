"""The Llama Transformer (Llama-2 and Llama-3.x), written to match Meta's reference code line for line.

Pre-norm decoder-only Transformer: RMSNorm, rotary position embeddings (RoPE), SwiGLU
feed-forward, grouped-query attention and a KV cache for incremental decoding. Parameter
names are Meta's, so a Meta state dict loads by key.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

NORMS = ("rmsnorm", "prmsnorm", "layernorm", "none")


@dataclass
class ModelArgs:
    """Model shape. Field names are those of Meta's params.json, so ModelArgs(**params) works.

    Meta's Llama-2 params.json says vocab_size: -1; the real size comes from the tokenizer
    and must be set before the model is built.
    """

    dim: int = 288
    n_layers: int = 6
    n_heads: int = 6
    n_kv_heads: Optional[int] = None  # None means n_heads: plain multi-head attention
    vocab_size: int = -1
    multiple_of: int = 256  # the SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None
    hidden_dim: Optional[int] = None  # the SwiGLU size stated outright (HF configs do); None: Meta's rule
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3.1's long-context RoPE scaling (see scale_rope_frequencies). The defaults are the
    # constants of Meta's apply_scaling; Llama-3.2 1B and 3B use a factor of 32.
    use_scaled_rope: bool = False
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192  # the context the model was pretrained with
    max_seq_len: int = 4096  # Llama-2's context length; Meta's file does not state it
    # Our own fields, for the normalisation ablation and for training from scratch.
    norm: str = "rmsnorm"  # one of NORMS
    norm_p: float = 1.0  # partial RMSNorm: the RMS is taken over the first ceil(dim * p) elements
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.norm not in NORMS:
            raise ValueError(f"unknown norm {self.norm!r}; choose one of {', '.join(NORMS)}")
        if not 0.0 < self.norm_p <= 1.0:
            raise ValueError(f"norm_p must be in (0, 1], got {self.norm_p}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head dim {self.dim // self.n_heads} must be even for RoPE")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.use_scaled_rope:
            self._check_rope_scaling()

    def _check_rope_scaling(self):
        for name in ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"RoPE scaling needs {name} to be a positive number, got {value!r}")
        if self.rope_scaling_factor < 1:
            raise ValueError(f"rope_scaling_factor must be >= 1 (it stretches the context), got {self.rope_scaling_factor}")
        if self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError(
                f"rope_high_freq_factor ({self.rope_high_freq_factor}) must be greater than "
                f"rope_low_freq_factor ({self.rope_low_freq_factor})"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        return self.hidden_dim or ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)

    @property
    def block_weights(self) -> int:
        """The weights of one block's matrices: attention's wq and wo (n_heads heads each), wk
        and wv (n_kv_heads), and SwiGLU's w1, w2 and w3."""
        return self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads) + 3 * self.dim * self.ffn_dim

    @property
    def n_parameters(self) -> int:
        """The parameters of Transformer(self) with RMSNorm, counted from the shape alone."""
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * (self.block_weights + 2 * self.dim) + embeddings + self.dim


def check_fits_context(args: ModelArgs, positions: int, what: str = "a sequence of {positions} tokens",
                       fix: str = "pass at most {context} tokens (or give the model a larger max_seq_len)") -> int:
    """The one check that a sequence fits the model's context, for the forward pass and for
    every caller that can say better what the positions are (a prompt and its new tokens, --ctx)
    and how to fix it (in its own arguments or flags). Returns the positions left after them;
    refuses more than max_seq_len in one line, {positions} and {context} filled in."""
    context = args.max_seq_len
    if positions > context:
        message = what + " exceeds max_seq_len {context}, the model's context; " + fix
        raise ValueError(message.format(positions=positions, context=context))
    return context - positions


# --- Normalisation -----------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square layer normalisation (Zhang & Sennrich, 2019), as in Meta's Llama.

    The statistic is computed in float32 whatever the input dtype, and the result is
    rounded back to the input dtype once, before the weight is applied. In bf16 a naive
    computation rounds the mean of squares and the reciprocal square root separately and
    drifts from the float32 answer; the upcast makes half-precision runs match fp32 ones.

    With p < 1 this is the paper's partial RMSNorm (eq. 8): the RMS is estimated from the
    first ceil(dim * p) elements only, and all elements are divided by it.
    """

    def __init__(self, dim: int, eps: float = 1e-6, p: float = 1.0):
        super().__init__()
        self.eps = eps
        self.p = p
        self.n_rms = dim if p >= 1.0 else math.ceil(dim * p)
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        x_rms = x if self.n_rms == x.shape[-1] else x[..., : self.n_rms]
        return x * torch.rsqrt(x_rms.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        # Meta's line as it is: the statistic in float32 for every input dtype, float64 included.
        output = self._norm(x.float()).type_as(x)
        return output * self.weight

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, p={self.p}"


def build_norm(args: ModelArgs) -> nn.Module:
    """The normalisation layer named by args.norm: the one switch of the ablation, decided
    when the model is built (torchtitan's build_norm)."""
    if args.norm == "layernorm":
        return nn.LayerNorm(args.dim, eps=args.norm_eps)
    if args.norm == "none":
        return nn.Identity()  # the paper's baseline without normalisation
    return RMSNorm(args.dim, args.norm_eps, args.norm_p if args.norm == "prmsnorm" else 1.0)


# --- Rotary position embeddings ----------------------------------------------------------


def rope_frequencies(args: ModelArgs, device=None) -> torch.Tensor:
    """Meta's inverse frequencies theta^(-2i/d) in float32, with Llama-3.1's scaling when asked for."""
    d = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, device=device)[: d // 2].float() / d))
    return scale_rope_frequencies(freqs, args) if args.use_scaled_rope else freqs


def scale_rope_frequencies(freqs, args: ModelArgs):
    """Llama-3.1: slow the low frequencies down by rope_scaling_factor so the context
    stretches that much, keep the high ones, and blend smoothly in between (Meta's
    apply_scaling, with its constants read from args)."""
    factor, low, high = args.rope_scaling_factor, args.rope_low_freq_factor, args.rope_high_freq_factor
    old_context_len = args.rope_original_max_seq_len
    wavelen = 2 * math.pi / freqs
    smooth = (old_context_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    scaled = torch.where(wavelen > old_context_len / low, freqs / factor, blended)
    return torch.where(wavelen < old_context_len / high, freqs, scaled)


def rope_cos_sin(args: ModelArgs, start_pos: int, seq_len: int, device=None):
    """The rotation for positions start_pos .. start_pos + seq_len - 1, as two float32 tables
    of shape (seq_len, 1, head_dim // 2, 2): cos of the angles pos * freq_i twice, and
    (-sin, sin) of them, laid out for apply_rotary_emb.

    Meta precomputes these for the whole context as complex numbers (freqs_cis). Computing
    them for the positions of each forward costs little and keeps memory proportional to the
    context actually used (a 128K-context model generating 50 tokens needs 50 rows), always
    in float32 whatever the model's dtype; real tables also compile better than complex ones
    (Inductor and Triton do not handle complex tensors).
    """
    t = torch.arange(start_pos, start_pos + seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, rope_frequencies(args, device))
    cos, sin = freqs.cos(), freqs.sin()
    return torch.stack((cos, cos), dim=-1)[:, None], torch.stack((-sin, sin), dim=-1)[:, None]


def apply_rotary_emb(x, cos, sin):
    """Rotate adjacent pairs (x[2i], x[2i+1]) of each head by angle pos * freq_i:
    (x0 cos - x1 sin, x1 cos + x0 sin), the real form of Meta's complex multiply, in float32,
    then cast back. x: (B, T, heads, head_dim); cos, sin from rope_cos_sin. Written as few
    operations as it takes: in a decoding step each operation's dispatch outweighs its arithmetic.
    roll swaps each pair as flip would, to the same bits, in 2/3 of flip's time on a CPU."""
    pairs = x.float().unflatten(-1, (-1, 2))
    return (pairs * cos + pairs.roll(1, -1) * sin).flatten(-2).type_as(x)


# --- Attention ---------------------------------------------------------------------------

_SDPA_HAS_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa is new in 2.5


class KVCache(nn.Module):
    """Keys and values of past positions, allocated once for the longest sequence.

    Preallocating avoids a torch.cat per generated token (quadratic copying) and keeps the
    shapes static for torch.compile. Layout (B, n_kv_heads, max_seq_len, head_dim), the one
    scaled_dot_product_attention reads. Its dtype may be narrower than the activations'
    (float16, llama.cpp's default): a long context's decoding step then reads half the bytes.
    """

    def __init__(self, batch_size, max_seq_len, n_kv_heads, head_dim, device, dtype):
        super().__init__()
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    def update(self, start_pos: int, k, v):
        """Store k, v (B, n_kv_heads, T, head_dim) at start_pos, rounded to the cache's dtype;
        return all keys and values so far, in k's dtype."""
        B, _, T, _ = k.shape
        end = start_pos + T
        if B > self.k.shape[0] or end > self.k.shape[2]:
            raise ValueError(
                f"{B} sequences up to position {end} do not fit the KV cache of {self.k.shape[0]} x "
                f"{self.k.shape[2]}; call setup_cache with a larger batch_size or max_seq_len"
            )
        self.k[:B, :, start_pos:end] = k
        self.v[:B, :, start_pos:end] = v
        return self.k[:B, :, :end].to(k.dtype), self.v[:B, :, :end].to(v.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.cache: Optional[KVCache] = None  # set by Transformer.setup_cache for decoding

    def rotate(self, x, cos, sin):
        """RoPE of q or k (kernels/fused_rope.py computes the same in one pass for training)."""
        return apply_rotary_emb(x, cos, sin)

    def forward(self, x, cos, sin, start_pos: int = 0):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, head_dim)

        if self.cache is not None:
            k, v = self.cache.update(start_pos, k, v)
        # Grouped-query attention: each key/value head serves n_heads // n_kv_heads query heads.
        # SDPA can read the shared heads in place (enable_gqa); copying them out with
        # repeat_interleave would copy the whole cache on every decoding step.
        gqa = {}
        if self.n_heads != self.n_kv_heads:
            if _SDPA_HAS_GQA:
                gqa = {"enable_gqa": True}
            else:
                n_rep = self.n_heads // self.n_kv_heads
                k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)

        if start_pos == 0:  # the whole sequence from position 0: plain causal attention
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        elif T == 1:  # one new token attends to everything cached
            out = F.scaled_dot_product_attention(q, k, v, **gqa)
        else:  # a chunk after cached positions: query i sees keys up to start_pos + i
            mask = torch.ones(T, start_pos + T, dtype=torch.bool, device=x.device).tril(start_pos)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


# --- Feed-forward --------------------------------------------------------------------------


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float] = None) -> int:
    """Meta's SwiGLU hidden size: 2/3 of 4*dim (three matrices cost what two did at 4*dim),
    optionally scaled, rounded up to a multiple of multiple_of. 7B: 4096 -> 11008."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        hidden = args.ffn_dim
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def gate(self, a, b):
        """SwiGLU's gate, silu(a) * b (kernels/fused_swiglu.py computes the same in one pass for training)."""
        return F.silu(a) * b

    def forward(self, x):
        return self.w2(self.gate(self.w1(x), self.w3(x)))


# --- The Transformer -----------------------------------------------------------------------


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = build_norm(args)
        self.ffn_norm = build_norm(args)

    def forward(self, x, cos, sin, start_pos: int = 0):
        h = x + self.attention(self.attention_norm(x), cos, sin, start_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError(
                f"vocab_size is {args.vocab_size} (Meta's params.json says -1); "
                "set it from the tokenizer, e.g. args.vocab_size = tokenizer.n_words"
            )
        self.args = args
        self.cache_dtype: Optional[torch.dtype] = None  # the KV cache's, where not the activations' (setup_cache)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = build_norm(args)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.apply(self._init_weights)
        # Scaled residual init (GPT-2, llama2.c): each block adds two outputs (wo, w2) to the
        # residual stream, so without scaling its variance grows with depth. Dividing their
        # std by sqrt(2 * n_layers) keeps the stream's scale independent of depth at init.
        for name, p in self.named_parameters():
            if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * args.n_layers))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def setup_cache(self, batch_size: int, max_seq_len: Optional[int] = None):
        """Allocate a KV cache on the model's device, in kv_dtype(), for incremental decoding.
        From now on every forward stores its keys and values in it; drop_cache() ends that."""
        max_seq_len = max_seq_len or self.args.max_seq_len
        device = next(self.parameters()).device
        for layer in self.layers:
            attn = layer.attention
            attn.cache = KVCache(batch_size, max_seq_len, attn.n_kv_heads, attn.head_dim, device, self.kv_dtype())

    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype: cache_dtype where set, else the activations'."""
        weight = next(self.parameters())  # the embedding's (held as integers: the first norm's), in the activations' dtype
        return self.cache_dtype or weight.dtype

    def drop_cache(self):
        """Free the KV cache: forwards then process each sequence on its own again."""
        for layer in self.layers:
            layer.attention.cache = None

    def forward(self, tokens, start_pos: int = 0, last_only: bool = False):
        """tokens (B, T) at positions start_pos .. start_pos + T - 1 -> float32 logits (B, T, vocab_size).

        Without a KV cache (training, scoring) the tokens are the whole sequence, so
        start_pos is 0. After setup_cache their keys and values are stored in the cache and
        earlier positions are read from it, as in Meta's code. last_only=True returns the
        logits of the last position only, (B, 1, vocab_size): all that sampling needs,
        without the output matmul over a whole prompt.
        """
        B, T = tokens.shape
        check_fits_context(self.args, start_pos + T)
        if start_pos > 0 and self.layers[0].attention.cache is None:
            raise RuntimeError("call model.setup_cache(batch_size) before decoding with start_pos > 0")
        cos, sin = rope_cos_sin(self.args, start_pos, T, tokens.device)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin, start_pos)
        if last_only:
            h = h[:, -1:]
        return self.output(self.norm(h)).float()
