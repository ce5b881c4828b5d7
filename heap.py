"""The C heap: hand the pages of freed chunks back to the OS (glibc's malloc_trim), or keep them for the next
chunks of their size (mallopt). Used where a process frees a lot that it will not need for a while (the
learner after a pass over long rows, an idle engine its blocked weights), and where it will at once (short
learner steps).
"""
import ctypes


def _libc(name: str):
    """A glibc function, or None where the C library is not glibc (macOS, musl)."""
    try:
        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc("malloc_trim")
_MALLOPT = _libc("mallopt")
# mallopt's parameters, and what glibc's own thresholds grow to (it sets them itself until a mallopt call)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
MMAP_MAX, MMAP_THRESHOLD_MAX, TRIM_THRESHOLD_MAX = 65536, 32 << 20, 64 << 20
# with keep_freed_chunks(True): free space at the heap's top up to this size stays resident
KEEP_TOP = 256 << 20
TOP_MAX = 1 << 30  # mallopt takes an int
_kept = 0  # the top kept resident (0: glibc's own settings)


def keep_freed_chunks(keep: bool, top: int = KEEP_TOP) -> None:
    """Whether large freed chunks stay resident for the next ones. glibc maps every chunk of 32 MB or more on
    its own and unmaps it when it is freed, and gives the top of the heap back past a threshold, so the next
    step's chunks fault their pages in again, zeroed by the kernel: a default learner step's logits and their
    gradient are a few such chunks, 250-600 MB of faults a step. With `keep`, every chunk comes from the heap
    and up to KEEP_TOP of free space stays at its top: the default run's learner time 0.89x, its trainer about
    100 MB larger (7bc33a1, docs/benchmarks.md, "Faster to a reward"). Off again (glibc's settings at their
    usual steady values) for steps that hand the heap's free pages back anyway; a process that never keeps is
    left to glibc. `top`: more free space at the top stays resident (capped at TOP_MAX), for a process that
    frees more than KEEP_TOP at once and makes it again (an engine's blocked weights, engines/builtin.py)."""
    global _kept
    top = min(top, TOP_MAX) if keep else 0
    if _MALLOPT is None or top == _kept:
        return
    _kept = top
    if keep:
        _MALLOPT(M_MMAP_MAX, 0)
        _MALLOPT(M_TRIM_THRESHOLD, top)
    else:
        _MALLOPT(M_MMAP_MAX, MMAP_MAX)
        _MALLOPT(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
        _MALLOPT(M_TRIM_THRESHOLD, TRIM_THRESHOLD_MAX)


def release_free_heap() -> None:
    """Hand the pages of the C heap's free chunks back to the OS. A pass over long rows frees gigabytes of
    activations in chunks of a few MB that glibc keeps in its heap between live tensors, where the next pass's
    differently sized ones do not all fit: without this the resident set grows by about 1 GB over a few passes
    of GSM8K's shape (docs/benchmarks.md, "Memory"). Likewise an engine's blocked weights, a few MB a matrix,
    stay resident after they are dropped. Costs one walk of the free lists and the next first touch of those
    pages."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
