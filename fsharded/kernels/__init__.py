"""Triton and C++/CUDA kernels with pure-torch references.

Nothing is exported yet: the kernels (fused optimizers, norms, cross-entropy, flash
attention, int8 quantisation) and their dispatch arrive with the kernels work. Importing
this package never requires CUDA, Triton or a compiler.
"""

__all__: list[str] = []
