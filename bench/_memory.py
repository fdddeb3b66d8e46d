"""A benchmark process's memory, probed: its RSS, its peak RSS and glibc's
heap after each phase of a run, kept by phase and printed as a table."""
from __future__ import annotations


def rss_kb() -> int:
    """This process's resident set size now, KiB (0 without /proc)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def heap_mb() -> tuple:
    """glibc's heap over all arenas: bytes in use and bytes free but kept
    (mallinfo2), MB; () where there is no glibc. Model states in native
    arenas or large tensors (mmap'd) are outside it."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return ()
    fn.restype = MallInfo2
    info = fn()
    return round(info.uordblks / 2**20), round(info.fordblks / 2**20)


def mark_phase(phases: dict, phase: str) -> None:
    """phases[phase] = this process's RSS, peak RSS so far and glibc heap
    (in use, free but kept), MB."""
    import resource

    phases[phase] = (round(rss_kb() / 1024, 1),
                     round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), *heap_mb())


def print_phases(phases: dict) -> None:
    """mark_phase's figures, one line a phase."""
    print("         rank 0, MB: RSS / peak RSS / glibc heap in use + free but kept", flush=True)
    for k, v in phases.items():
        heap = f" / {v[2]:4d} + {v[3]:3d}" if len(v) > 2 else ""
        print(f"           {k:<10} {v[0]:6.0f} / {v[1]:4.0f}{heap}", flush=True)
