"""Optional fused kernels, each a drop-in subclass of a model.py module.

model.build_norm imports this package only when a fused implementation is asked for, so
`import llama_mini` never compiles or loads anything. Removing a kernel is one commit:
delete its files here and the lines of build_norm that import it.
"""

from .fused_rmsnorm import FusedRMSNorm, fused_rms_norm

__all__ = ["FusedRMSNorm", "fused_rms_norm"]
