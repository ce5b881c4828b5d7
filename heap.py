"""The C heap: hand the pages of freed chunks back to the OS (glibc's malloc_trim). Used where a process frees a
lot that it will not need for a while: the learner after a pass over long rows, an idle engine its blocked weights.
"""
import ctypes


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library is not glibc (macOS, musl)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def release_free_heap() -> None:
    """Hand the pages of the C heap's free chunks back to the OS. A pass over long rows frees gigabytes of
    activations in chunks of a few MB that glibc keeps in its heap between live tensors, where the next pass's
    differently sized ones do not all fit: without this the resident set grows by about 1 GB over a few passes of
    GSM8K's shape (docs/benchmarks.md, "Memory"). Likewise an engine's blocked weights, a few MB a matrix, stay
    resident after they are dropped. Costs one walk of the free lists and the next first touch of those pages."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
