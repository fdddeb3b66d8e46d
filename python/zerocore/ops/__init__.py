"""Optimizer kernels on flat tensors (1-D, contiguous, CPU), zero-copy.

``adam_`` and ``sgd_`` follow torch.optim's update rules exactly (bias
correction, eps outside the square root, decoupled weight decay for AdamW,
L2 for Adam; SGD momentum, dampening, nesterov). The gradient may be fp32,
bf16 or fp16 and is multiplied by ``grad_scale`` in the same pass (fold
loss-scale unscaling and clipping into it); ``param_copy`` (bf16 or fp16), if
given, receives the updated params in the same pass. Bad arguments raise
``TypeError`` (dtype, device) or ``ValueError`` (sizes, layout, ranges)
before any memory is written. The instruction set and thread count are
chosen at run time: see ``zerocore.cpu_features()``.

``FlatRuns`` holds a whole partition as runs (each stretch in one optimizer
param group) and steps them all in one call, split over the threads
together; ``sum_of_squares`` is the fp64 squared norm of many tensors in one
pass (non-finite exactly when an element is: the overflow check too).
"""

from zerocore._native import FlatRuns, adam_, sgd_, sum_of_squares

__all__ = ["FlatRuns", "adam_", "sgd_", "sum_of_squares"]
