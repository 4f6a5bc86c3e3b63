"""Optional CPU kernels, each behind a drop-in subclass of a torch or model.py module.

- fused_rmsnorm: RMSNorm in one pass over memory (model.build_norm picks it).
- matvec: the matrix-vector products of decoding and a layer's decoding step in one call
  (use_matvec, and the quantized layers).

Both compile into one library, once per machine, the first time a model uses them (build.py);
importing them compiles and loads nothing.
"""

from .fused_rmsnorm import FusedRMSNorm, fused_rms_norm
from .matvec import MatvecLinear, use_matvec

__all__ = ["FusedRMSNorm", "MatvecLinear", "fused_rms_norm", "use_matvec"]
