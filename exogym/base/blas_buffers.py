"""Give back the scratch memory the BLAS library keeps for the calling thread.

torch's x86 wheels carry Intel MKL, whose memory manager keeps, for every
thread that has run a matrix product, a buffer of about a megabyte for the
next one. A packed simulation (:mod:`exogym.comm.packed`) runs hundreds of
ranks as threads of one process, each running in turn; every one of them
kept its own buffer, which at K=1024 came to about 1 GiB that no rank was
using. :func:`release_thread_buffers` frees what MKL lets go of the calling
thread's buffers (it keeps one while the thread lives), so that a rank that
hands its turn on keeps little; the next rank's product takes the memory back
from the allocator instead of the system.

Where torch has no MKL (macOS, ARM, other BLAS libraries) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

__all__ = ["release_thread_buffers", "thread_buffers_releasable"]

#: MKL's names of the call that frees the calling thread's buffers: the public ones, for a
#: torch linked to a shared MKL, and the one a torch with MKL built in exports.
_NAMES = ("mkl_thread_free_buffers", "MKL_Thread_Free_Buffers", "mkl_serv_thread_free_buffers")


@functools.lru_cache(maxsize=1)
def _free_call() -> Callable[[], None] | None:
    """MKL's per-thread release, looked up once among the loaded libraries and torch's own
    (None where there is none)."""
    import torch

    candidates: list[ctypes.CDLL] = [ctypes.CDLL(None)]
    for path in sorted(Path(torch.__file__).parent.joinpath("lib").glob("libtorch_cpu.*")):
        try:
            candidates.append(ctypes.CDLL(str(path)))  # already loaded: the same library
        except OSError:
            continue
    for library in candidates:
        for name in _NAMES:
            call = getattr(library, name, None)
            if call is not None:
                call.restype = None
                call.argtypes = []
                return call
    return None


def thread_buffers_releasable() -> bool:
    """Whether this torch's BLAS keeps per-thread buffers that can be given back (MKL)."""
    return _free_call() is not None


def release_thread_buffers() -> None:
    """Free the BLAS buffers the calling thread keeps for its next matrix product (a thread
    about to wait a long while, or to end); where there are none to free, nothing."""
    call = _free_call()
    if call is not None:
        call()
