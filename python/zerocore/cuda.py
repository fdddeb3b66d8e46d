"""CUDA kernels: fused optimizers on flat partitions of GPU memory.

The extension module ``zerocore._cuda`` is imported on first use, not when
this module is imported, and it never touches CUDA at import time, so
``import zerocore.cuda`` works on any machine. ``is_built()`` says whether
the package was built with the CUDA kernels, ``is_available()`` whether they
can run here (a driver and at least one device).

In a build with CUDA, ``zerocore._native.CudaBackend`` is the runtime's
CUDA backend (docs/runtime.md, "The CUDA backend"); it lives in ``_native``
beside the runtime objects that run on it.

``adam_`` has the semantics of ``zerocore.ops.adam_`` (torch.optim's Adam /
AdamW) and rounds bit for bit like it, on 1-D contiguous CUDA tensors. It is
queued on torch's current stream of the tensors' device, so it is ordered
with the torch work around it and, like any CUDA op, returns before the
update has run.
"""

from __future__ import annotations

_ext = None  # the zerocore._cuda module once loaded
_import_error: ImportError | None = None


def _load():
    """The extension module, or None when the package was built without it."""
    global _ext, _import_error
    if _ext is None and _import_error is None:
        try:
            from zerocore import _cuda
        except ImportError as e:  # built without CUDA (ZEROCORE_CUDA=OFF or no nvcc)
            _import_error = e
        else:
            _ext = _cuda
    return _ext


def is_built() -> bool:
    """True when zerocore was built with its CUDA kernels."""
    return _load() is not None


def device_count() -> int:
    """Number of CUDA devices the kernels can use; 0 without the extension,
    a driver or a device."""
    ext = _load()
    return 0 if ext is None else int(ext.device_count())


def is_available() -> bool:
    """True when the CUDA kernels are built and a device can run them. Never
    raises."""
    try:
        return device_count() > 0
    except Exception:
        return False


def _require():
    ext = _load()
    if ext is None:
        raise RuntimeError(
            "zerocore was built without its CUDA kernels (the zerocore._cuda extension "
            f"is missing: {_import_error}); rebuild with ZEROCORE_CUDA=ON and nvcc on PATH"
        )
    if ext.device_count() == 0:
        raise RuntimeError(
            f"zerocore.cuda: no CUDA device can be used ({ext.unavailable_reason()}); "
            "check the NVIDIA driver (the kernels need one recent enough for the CUDA "
            "toolkit they were built with) and CUDA_VISIBLE_DEVICES"
        )
    return ext


def _current_stream(t) -> int:
    """The cudaStream_t of torch's current stream on t's device (0 for a
    non-CUDA tensor: the native checks then report the device mismatch)."""
    if getattr(t, "is_cuda", False):
        import torch

        return int(torch.cuda.current_stream(t.device).cuda_stream)
    return 0


def _detach(t):
    # torch refuses to export a tensor that requires grad through DLPack; the
    # update is an in-place optimizer step, outside autograd anyway.
    return t.detach() if hasattr(t, "detach") else t


def adam_(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw: bool = True,
    grad_scale: float = 1.0,
    param_copy=None,
) -> None:
    """In-place fused Adam/AdamW step on flat CUDA tensors.

    ``param``, ``exp_avg`` and ``exp_avg_sq`` are float32; ``grad`` is
    float32, bfloat16 or float16 and is multiplied by ``grad_scale``;
    ``param_copy`` (bfloat16 or float16), if given, receives the new params
    in the same pass. All are 1-D, contiguous, the same length and on the
    same device. ``step`` counts from 1. Raises TypeError (dtype, device),
    ValueError (sizes, shape, ranges) before anything is launched, and
    RuntimeError when the kernels are not built or no device exists.
    """
    ext = _require()
    ext.adam_(
        _detach(param),
        _detach(grad),
        _detach(exp_avg),
        _detach(exp_avg_sq),
        step=step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        adamw=adamw,
        grad_scale=grad_scale,
        param_copy=None if param_copy is None else _detach(param_copy),
        stream=_current_stream(param),
    )


__all__ = ["adam_", "device_count", "is_available", "is_built"]
