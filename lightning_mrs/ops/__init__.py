"""The MRSNorm op in one place (in the spirit of Liger-Kernel's ``ops/``).

============================ =====================================================
``mrs_norm.py``              the public entry points ``mrs_norm`` and ``mrs_scale``
``validation.py``            argument checks, and ``compute_dtype`` (half -> fp32)
``reference.py``             the formula in plain torch: the reference
``dispatch.py``              the backend table, and the plan of a call in one cache
``plan.py``                  the plans: C++ rows (the fast path), a backend's fused kernels, the formula
``function.py``              the autograd Function saving only ``x`` and ``P * S``
``layout.py``                any layout as the kernels' 3-d view, and back
``library.py``               the op as torch.library ops: what ``torch.compile`` sees
``torch_kernels.py``         backend ``torch``: forward/backward bodies, eager
``inductor_kernels.py``      backend ``inductor``: the same bodies, compiled
``cpu_kernels.py``, ``.cpp`` backend ``cpp``: hand-written one-pass CPU kernels
``triton_kernels.py``        backend ``triton``: hand-written CUDA kernels
``triton_launch.py``         their tiles, warps and grids, as pure functions
============================ =====================================================
"""

from lightning_mrs.ops.mrs_norm import BACKENDS, mrs_norm, mrs_scale, which_backend

__all__ = ["BACKENDS", "mrs_norm", "mrs_scale", "which_backend"]
