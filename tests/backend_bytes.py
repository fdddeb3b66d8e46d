"""engine.memory_report() against the bytes its backend holds
(Backend.allocated_bytes(): the live buffers it allocated, by memory
kind), for the CPU test (test_engine_accounting.py) and the GPU one
(test_gpu_engine.py)."""

# The memory kinds each of the report's places is: "host" is pinned memory,
# or pageable where pinning failed (the CUDA backend falls back, and says so).
KINDS_OF = {"device": ("device",), "host": ("host_pinned", "host_pageable")}

# What the report counts that is not its backend's memory, and why.
NOT_THE_BACKENDS = {
    "buffers": "the module's buffers are torch tensors the module keeps (wrap casts them in place)",
    "activations": "zerocore.checkpoint's buffers are its own backend's (the process's on the CPU, a CudaBackend of "
                   "its own per CUDA device), not the engine's where it was given one or runs on CUDA",
}


def backend_places(report: dict) -> dict:
    """{place: bytes} that the report says the engine's backend holds."""
    return {place: sum(n for k, n in counts.items() if k not in NOT_THE_BACKENDS)
            for place, counts in report["by_device"].items()}


def assert_report_is_the_backends(report: dict, allocated: dict, what: str):
    """The report's bytes in each place equal what the backend allocated of
    that place's kinds."""
    assert set(report["by_device"]) == set(KINDS_OF), report["by_device"]
    places = backend_places(report)
    for place, kinds in KINDS_OF.items():
        held = sum(allocated[k] for k in kinds)
        assert places[place] == held, f"{what}: the report counts {places[place]} bytes on the {place} " \
                                      f"({report['by_device'][place]}), its backend holds {held} ({allocated})"
