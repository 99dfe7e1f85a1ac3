"""Python's garbage collector kept out of the training steps (``train.gc_every``).

CPython's automatic collector runs a full (generation-2) collection whenever enough objects have
survived younger ones; in a training process holding millions of objects (tokenised data, the
history, compiled graphs) one such pause took 1.5 s inside a 38-s step at N = 131,072 on an H200
(docs/benchmarks.md). As torchtitan does, training turns the automatic collector off and collects
itself: the young generations (0 and 1) every ``every`` optimizer steps, which is cheap, and the whole
heap only between steps where time is not measured (after in-training evaluations, and every
:data:`FULL_EVERY` × ``every`` steps in the loop). Objects alive when training starts are frozen
(``gc.freeze``): no collection scans them again.
"""
from __future__ import annotations

import contextlib
import gc

#: the training loop's full collection comes every FULL_EVERY * train.gc_every steps
FULL_EVERY = 20


@contextlib.contextmanager
def manual_collection(every: int | None):
    """Inside the block: automatic collection off, everything alive at entry frozen (after one full
    collection); at exit both restored. ``every`` None: Python's automatic collector, unchanged."""
    if not every:
        yield
        return
    was = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was:
            gc.enable()


def young_collection(step: int, every: int | None) -> bool:
    """After optimizer step ``step`` (1-based): collect generations 0 and 1 when ``step`` is a multiple of
    ``every`` and the automatic collector is off (inside :func:`manual_collection`). Returns whether it ran."""
    if not every or gc.isenabled() or step % every:
        return False
    gc.collect(1)
    return True


def full_collection(step: int | None, every: int | None) -> bool:
    """A full collection between steps: at ``step`` a multiple of ``FULL_EVERY * every``, or always with
    ``step`` None (after an in-training evaluation); only inside :func:`manual_collection`. Returns whether it ran."""
    if not every or gc.isenabled() or (step is not None and step % (FULL_EVERY * every)):
        return False
    gc.collect()
    return True
