"""The MRSNorm op in one place (in the spirit of Liger-Kernel's ``ops/``); the life of a call
through it is in docs/development.md#life-of-a-call.

================================== ====================================================
``mrs_norm.py``                    the public entry points, and the router: formula or operator
``validation.py``, ``reference.py``  the argument checks; the formula in plain torch, the reference
``dispatch.py``                    the backend table: which kernel runs a kind of call (cached)
``library.py``                     the operators, their fake kernels, the one autograd Function
``layout.py``                      any layout as the kernels' 3-d view, and back
``torch_kernels.py``               backend ``torch``: the bodies (``inductor_kernels.py``: compiled)
``cpu_kernels.py``, ``.cpp``, .h   backend ``cpp``: the operators' C++ CPU kernels, built on first use
``triton_kernels.py``              backend ``triton``: their CUDA kernels (``triton_launch.py``)
================================== ====================================================
"""

from lightning_mrs.ops.mrs_norm import BACKENDS, mrs_norm, mrs_scale, which_backend

__all__ = ["BACKENDS", "mrs_norm", "mrs_scale", "which_backend"]
