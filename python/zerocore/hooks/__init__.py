"""The module and autograd hooks that drive the native engine during forward and backward: stage 3's units
and the gradient reduction."""
