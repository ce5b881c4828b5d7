"""The reward service: score untrusted replies in worker processes that can be killed when they hang.

    with RewardPool("math", workers=2, timeout_s=5.0) as pool:
        scores = pool.score(completions, references)     # blocking
        handle = pool.submit(completions, references)    # keep generating meanwhile ...
        scores = handle.result()

A verifier that raises scores 0 (`errors` += 1); one that runs past `timeout_s` is killed with its process,
scores 0 (`timeouts` += 1) and a fresh worker takes its place. A verifier with a `take_counts()` method (the
code reward's sandbox kills) adds what it returns to `counts` after every reply. Workers score one reply at a
time, in their main thread (math-verify's alarms need it); a dispatcher thread in the owner feeds them, so
submitted work goes on while the owner generates. `workers=0` scores in the caller's thread: no processes, no
timeout.
"""
import collections
import ctypes
import multiprocessing as mp
import os
import signal
import threading
import time
from multiprocessing.connection import wait

from rewards import get_reward

STARTUP_TIMEOUT_S = 120.0  # a spawned worker imports its verifier (sympy: a second or two) before it is ready


class ScoreHandle:
    """Scores of one submitted batch, filled in by the pool as workers finish."""

    def __init__(self, n: int):
        self.scores, self.left, self.error = [0.0] * n, n, None
        self._done = threading.Event()
        if n == 0:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> list[float]:
        if not self._done.wait(timeout):
            raise TimeoutError(f"scores not ready after {timeout} s")
        if self.error is not None:
            raise RuntimeError(self.error)
        return list(self.scores)

    def _fill(self, index: int, score: float):
        self.scores[index] = score
        self.left -= 1
        if self.left == 0:
            self._done.set()

    def _fail(self, error: str):
        self.error = error
        self._done.set()


class RewardPool:
    def __init__(self, reward: str, workers: int, timeout_s: float, options: dict | None = None):
        if workers < 0 or timeout_s <= 0:
            raise ValueError(f"RewardPool needs workers >= 0 and timeout_s > 0 (got {workers}, {timeout_s})")
        self.reward, self.timeout_s, self.options = reward, timeout_s, dict(options or {})
        self.timeouts = self.errors = 0
        self.counts: collections.Counter = collections.Counter()  # the verifier's own counts (take_counts)
        self._verifier = get_reward(reward, **self.options) if workers == 0 else None
        self._queue = collections.deque()  # (handle, index, completion, reference) not yet sent to a worker
        self._lock = threading.Lock()
        self._closing = self._closed = False
        self._fatal: str | None = None
        if workers == 0:
            return
        self._ctx = mp.get_context("spawn")
        self._wake_r, self._wake_w = os.pipe()  # submit() and close() wake the dispatcher through it
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._workers: list[_Worker] = []
        self._ready = threading.Event()
        # Workers are started by this thread: PR_SET_PDEATHSIG fires when the thread that started a process
        # exits, so they die with the dispatcher, and with the owner, however either ends.
        self._thread = threading.Thread(target=self._dispatch, args=(workers,), name="reward-pool",
                                        daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._fatal is not None:
            self.close()
            raise RuntimeError(self._fatal)

    def score(self, completions: list[str], references: list[str]) -> list[float]:
        return self.submit(completions, references).result()

    def submit(self, completions: list[str], references: list[str]) -> ScoreHandle:
        if len(completions) != len(references):
            raise ValueError(f"{len(completions)} completions but {len(references)} references")
        handle = ScoreHandle(len(completions))
        if self._verifier is not None:
            for i, (completion, reference) in enumerate(zip(completions, references)):
                handle._fill(i, self._score_here(completion, reference))
            return handle
        with self._lock:
            if self._closing or self._fatal is not None:
                raise RuntimeError(self._fatal or "the reward pool is closed")
            self._queue.extend((handle, i, c, r) for i, (c, r) in enumerate(zip(completions, references)))
            self._wake()
        return handle

    def _score_here(self, completion: str, reference: str) -> float:
        try:
            return float(self._verifier(completion, reference))
        except Exception:  # the same rule as in a worker: a verifier's failure is a wrong answer
            self.errors += 1
            return 0.0
        finally:
            self.counts.update(_counts(self._verifier))

    def close(self):
        if self._verifier is not None or self._closed:
            return
        self._closed = True
        with self._lock:
            self._closing = True
            self._wake()
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self):
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:  # the pipe is full: the dispatcher has wake-ups waiting already
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # The dispatcher thread: the only code that touches the workers, the jobs and the handles' scores.

    def _dispatch(self, n_workers: int):
        try:
            self._workers = [_Worker(self._ctx, self.reward, self.options) for _ in range(n_workers)]
            while not self._closing:
                if all(w.ready for w in self._workers):
                    self._ready.set()
                self._assign()
                for conn in wait([self._wake_r] + [w.conn for w in self._workers], self._next_deadline()):
                    if conn == self._wake_r:
                        os.read(self._wake_r, 1 << 16)  # wake-ups carry no data; one read empties the pipe
                    else:
                        self._receive(next(w for w in self._workers if w.conn is conn))
                self._expire()
        except Exception as e:  # a worker that cannot start, or a bug here: fail loudly, never hang callers
            self._fatal = f"reward pool '{self.reward}' failed: {e}"
        finally:
            for worker in self._workers:
                worker.kill()
            with self._lock:
                self._closing = True
                pending = {job[0] for job in self._queue} | {w.job[0] for w in self._workers if w.job}
                self._queue.clear()
            for handle in pending:
                handle._fail(self._fatal or "the reward pool was closed before these replies were scored")
            self._ready.set()

    def _assign(self):
        with self._lock:
            for worker in self._workers:
                if worker.ready and worker.job is None and self._queue:
                    handle, index, completion, reference = self._queue.popleft()
                    worker.job, worker.deadline = (handle, index), time.monotonic() + self.timeout_s
                    try:
                        worker.conn.send((completion, reference))
                    except OSError:
                        # it died while idle: wait() reports the closed pipe, _receive replaces it
                        pass

    def _next_deadline(self) -> float | None:
        deadlines = [w.deadline for w in self._workers if w.job is not None or not w.ready]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _receive(self, worker: "_Worker"):
        try:
            status, value, counts = worker.conn.recv()
        except (EOFError, OSError):  # it killed its own process (os._exit, a segfault, the OOM killer)
            if not worker.ready:
                raise RuntimeError("a worker died while starting") from None
            self._finish(worker, 0.0, "errors")
            self._replace(worker)
            return
        if status == "fatal":
            raise RuntimeError(value)
        if status == "ready":
            worker.ready = True
        else:
            self.counts.update(counts)
            self._finish(worker, value, "errors" if status == "error" else None)

    def _expire(self):
        now = time.monotonic()
        for worker in list(self._workers):
            if now < worker.deadline:
                continue
            if not worker.ready:
                raise RuntimeError(f"a worker did not start within {STARTUP_TIMEOUT_S} s")
            if worker.job is not None:
                self._finish(worker, 0.0, "timeouts")
                self._replace(worker)

    def _finish(self, worker: "_Worker", score: float, counter: str | None):
        if worker.job is None:
            return
        if counter is not None:
            setattr(self, counter, getattr(self, counter) + 1)
        handle, index = worker.job
        worker.job = None
        handle._fill(index, score)

    def _replace(self, worker: "_Worker"):  # the fresh worker gets replies once it says it is ready
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._ctx, self.reward, self.options)


class _Worker:
    """A process, our end of its pipe, the (handle, index) it scores, and when its start or its job is
    late."""

    def __init__(self, ctx, reward: str, options: dict):
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(reward, options, child_conn), name="reward",
                                   daemon=True)
        self.process.start()
        child_conn.close()
        self.ready = False
        self.job: tuple[ScoreHandle, int] | None = None
        self.deadline = time.monotonic() + STARTUP_TIMEOUT_S

    def kill(self):
        self.process.kill()
        self.process.join()
        self.conn.close()


def _worker_main(reward: str, options: dict, conn):
    try:  # Linux: the kernel kills this process when the thread that started it ends
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != mp.parent_process().pid:  # the owner died before the line above took effect
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the owner's to handle
    try:
        verifier = get_reward(reward, **options)
    except Exception as e:
        conn.send(("fatal", str(e), None))
        return
    conn.send(("ready", None, None))
    while True:
        try:
            completion, reference = conn.recv()
        except EOFError:  # the owner closed the pipe or died
            return
        try:
            status, score = "ok", float(verifier(completion, reference))
        except Exception:
            status, score = "error", 0.0
        conn.send((status, score, _counts(verifier)))


def _counts(verifier) -> dict:
    take = getattr(verifier, "take_counts", None)
    return take() if take is not None else {}
