"""What runs inside the sandbox (rewards/sandbox.py): set the limits, read the job, run the program, report.

Never imported by ringrl: its source is handed to the sandbox's interpreter as
`python -I -S -c <this file> <fd>`. The job (a marshalled dict) comes through the inherited descriptor <fd>,
which is closed before any untrusted code runs, so the program cannot read it back. It imports only built-in
modules (and `collections` for the value checks): a run's start-up is most of its cost.

Reports go to a private copy of stderr, one line per case: `<marker> <case> ok|fail|memory`. The marker is
random and new for every run and is never shown to the program, so a report proves that the runner, not the
program, got there: a program that exits early (`sys.exit(0)`, `os._exit(0)`) or is killed reports nothing.

Asserts (function + asserts jobs) arrive rewritten by rewards/sandbox.py (`guard`): every value they compare,
or test for truth, goes through `__ringrl_plain__` first, and they are compiled before the program runs.
`plain` lets through only built-in and standard-library value types whose comparison methods are unchanged
since start, so an object whose `__eq__` always returns True fails, and so does a patched builtin the asserts
call (they see a copy of the builtins taken before the program ran). Code in the same process can still reach
the runner's frames; the sandbox, not this file, is what keeps such a program from doing harm.
"""
import builtins
import marshal
import os
import resource
import sys


def main():
    fd = int(sys.argv[1])
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    job = marshal.loads(b"".join(chunks))
    set_limits(job["limits"])
    report = reporter(job["marker"].encode(), os.dup(2), os.write)
    exit_ = os._exit
    builtins.exit = builtins.quit = sys.exit  # `site` (skipped by -S) would define them; programs call exit()
    if job["tests"] is None:
        exit_(run_stdio(job, report))
    exit_(run_function(job, report))


def set_limits(limits: dict):
    cpu = limits["cpu_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU first, SIGKILL a second later
    for name, value in (("RLIMIT_AS", limits["memory_bytes"]), ("RLIMIT_NPROC", limits["processes"]),
                        ("RLIMIT_FSIZE", limits["file_bytes"]), ("RLIMIT_CORE", 0), ("RLIMIT_NOFILE", 256)):
        resource.setrlimit(getattr(resource, name), (value, value))


def reporter(marker: bytes, fd: int, write):
    def report(case: int, status: str):
        try:
            write(fd, b"\n%s %d %s\n" % (marker, case, status.encode()))
        except OSError:  # the program closed our descriptor: nothing more can be reported, so nothing passes
            pass
    return report


def run_stdio(job: dict, report) -> int:
    out, status = sys.stdout, "ok"
    try:
        exec(compile(job["setup"] + "\n" + job["program"], "<program>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        status = "ok" if e.code in (None, 0) else "fail"
    except MemoryError:
        status = "memory"
    except BaseException:
        status = "fail"
    try:
        out.flush()
    except BaseException:  # stdout closed or replaced by something broken: the output is not what was printed
        status = "fail"
    report(0, status)
    return 0


def run_function(job: dict, report) -> int:
    tests = [compile(test, f"<test {i}>", "exec") for i, test in enumerate(job["tests"])]
    clean = dict(vars(builtins))
    plain = plain_checker(job["exact_numbers"])
    # The program may rebind builtins and sys: from here on, only what was bound before it ran is used.
    settrace, setprofile, exec_, dict_, enumerate_ = sys.settrace, sys.setprofile, exec, dict, enumerate
    program = {"__name__": "__main__"}
    try:
        exec(compile(job["setup"] + "\n" + job["program"], "<program>", "exec"), program)
    except MemoryError:
        report(-1, "memory")
        return 0
    except BaseException:  # it did not even define its functions (SystemExit included): every case fails
        return 0
    for i, test in enumerate_(tests):
        settrace(None)
        setprofile(None)
        scope = dict_(program, __builtins__=clean, __ringrl_plain__=plain)
        try:
            exec_(test, scope)
            report(i, "ok")
        except MemoryError:
            report(i, "memory")
        except BaseException:
            report(i, "fail")
    return 0


def plain_checker(exact_numbers: bool):
    """`plain(value)`: the value if it, and everything it contains, is of a trusted type whose comparison
    methods are those it had at start; else AssertionError. Built before the program runs. Fraction and
    Decimal are trusted only when the asserts name them (`exact_numbers`): importing them costs more than a
    whole run."""
    import collections

    trusted = (bool, int, float, complex, str, bytes, type(None), list, tuple, dict, set, frozenset, range,
               collections.Counter, collections.OrderedDict, collections.defaultdict, collections.deque)
    if exact_numbers:
        import decimal
        import fractions
        trusted += (fractions.Fraction, decimal.Decimal)
    names = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__bool__", "__len__", "__iter__",
             "__getitem__", "__contains__", "__missing__", "__hash__")
    methods = {t: tuple(getattr(t, n, None) for n in names) for t in trusted}
    containers = (list, tuple, set, frozenset, collections.deque)
    # The program may rebind builtins and module attributes: this code uses only what it bound at start.
    type_, getattr_, isinstance_, zip_, any_, next_ = type, getattr, isinstance, zip, any, next
    items, error = dict.items, AssertionError

    def check(value, depth=0):
        t = type_(value)
        b = next_((b for b in t.__mro__ if b in methods), None)
        # `is`, not ==: a method object of the program's could compare equal to anything
        if b is None or depth > 50 or any_(getattr_(t, n, None) is not m for n, m in zip_(names, methods[b])):
            raise error("not a plain value")
        if isinstance_(value, dict):
            for k, v in items(value):
                check(k, depth + 1)
                check(v, depth + 1)
        elif isinstance_(value, containers):
            for x in value:
                check(x, depth + 1)

    def plain(value):
        check(value)
        return value
    return plain


if __name__ == "__main__":
    main()
