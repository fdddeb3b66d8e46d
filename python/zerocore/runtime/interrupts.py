"""Ctrl-C between a native call and the Python that mirrors it.

Python runs a signal's handler (SIGINT's raises KeyboardInterrupt) in the
main thread at the next bytecode after the signal arrives: while a native
call waits for its peers, that is the moment the call returns. Where Python
then records what the call did (stage 3's hooks bind the params of the unit
the schedule gathered, the step counts the update it applied), an
interrupt there would leave the two disagreeing: the params of a unit the
schedule holds bound would still point at placeholders, and the next
release of that unit would find no binding to undo. `deferred()` holds a
SIGINT that arrives inside it until it ends, then raises it as the handler
in force would, so the KeyboardInterrupt comes out with the engine whole:
zero_grad() and save() work in the user's handler.
"""
from __future__ import annotations

import contextlib
import signal
import threading

_held = []  # the (signum, frame) of a SIGINT that arrived while deferred
_deferring = False


def _hold(signum, frame):
    _held.append((signum, frame))


@contextlib.contextmanager
def deferred():
    """SIGINT arriving inside is handled when it ends. Only the main thread
    runs Python's signal handlers, so elsewhere (autograd's device threads)
    nothing can interrupt and this does nothing; nested, the outer one holds."""
    global _deferring
    handler = signal.getsignal(signal.SIGINT)
    if _deferring or not callable(handler) or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.signal(signal.SIGINT, _hold)
    _deferring = True
    try:
        yield
    finally:
        _deferring = False
        signal.signal(signal.SIGINT, handler)
        if _held:
            signum, frame = _held[0]
            _held.clear()
            handler(signum, frame)
