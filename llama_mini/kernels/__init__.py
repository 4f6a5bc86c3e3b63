"""CPU kernels, each applied to a built model from outside by one call; nothing in the core imports them.

    use_fused_rmsnorm(model)   RMSNorm in one pass over memory each way (fused_rmsnorm.py)
    use_fused_swiglu(model)    the feed-forward's gate in one pass each way, for training (fused_swiglu.py)
    use_fused_rope(model)      RoPE in one pass each way, for training: the model's bits (fused_rope.py)
    use_cpu_kernels(model)     linear layers and whole blocks on the kernels, for prompts and decoding
                               steps (cpu_kernels.py: linear.py, block.py)

Each swaps modules for subclasses that compute the same function faster, keeping every weight
and state-dict name (operators.swap_classes), and only where the core code the subclass stands
in for is the code it was written for (fingerprints.py): a layer whose core function was edited
keeps the edited code, and one line says so. The kernels compile into one library, once per
machine, when first applied (build.py); importing this package compiles and loads nothing.

flush_subnormals() sets the process, not a model: every CPU thread reads and writes subnormal
floats as zero, for training's --flush-denormals (subnormals.py).
"""

from .cpu_kernels import on_kernels, use_cpu_kernels
from .fused_rmsnorm import FusedRMSNorm, use_fused_rmsnorm
from .fused_rope import FusedAttention, use_fused_rope
from .fused_swiglu import FusedFeedForward, use_fused_swiglu
from .subnormals import flush_subnormals

__all__ = ["FusedAttention", "FusedFeedForward", "FusedRMSNorm", "flush_subnormals", "on_kernels", "use_cpu_kernels",
           "use_fused_rmsnorm", "use_fused_rope", "use_fused_swiglu"]
