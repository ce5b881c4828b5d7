"""Environment steps beside the engine: a pool of daemon threads, each step with a deadline from its start.

Generation never waits for an environment. The rollout worker submits `env.step(text)` and polls; a step that
runs past its deadline, counted from when a thread starts it, is abandoned and its episode ends `env_timeout`
(a step still waiting in the queue is bounded by its episode's own timeout, not by this one). Its thread is
written off: a thread cannot be killed, so the pool starts another in its place and counts it (`stuck`); the
stuck one exits when its step returns, after the clean-up its episode left it (`env.close()`: never while the
step still runs). Threads are daemons, so a step that never returns cannot hold the process at exit. Threads
suit trusted pure-Python environments and waits that use no core (a remote tool, a sleep); anything that runs
model-written code goes through the sandbox (rewards/sandbox.py) from inside its step, which bounds it in time
and memory.
"""
import queue
import threading
import time


class Pending:
    """One submitted call: done() once it returned or raised, or ran past its deadline (timed_out)."""

    def __init__(self, fn, args, timeout_s: float):
        self.fn, self.args, self.timeout_s = fn, args, timeout_s
        self.submitted = time.monotonic()
        self.started = self.finished = 0.0  # time.monotonic() at its start and its end (0: not yet)
        self.value, self.error, self.timed_out = None, None, False
        self._done = threading.Event()
        # Between the thread that runs it and the caller that writes it off: which of the two cleans up.
        self._lock = threading.Lock()
        self._cancelled = False  # written off before a thread took it: never run
        self._cleanup = None  # written off while running: what its thread calls once the call returns

    def done(self) -> bool:
        if self._done.is_set():
            return True
        if self.started and time.monotonic() > self.started + self.timeout_s:
            self.timed_out = True
            return True
        return False

    def result(self):
        """The call's value; raises what it raised."""
        if self.error is not None:
            raise self.error
        return self.value


class StepPool:
    def __init__(self, threads: int, timeout_s: float, name: str = "env"):
        self.timeout_s, self.name = timeout_s, name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self.stuck = 0  # threads written off with a step that ran past its deadline
        for _ in range(threads):
            self._spawn()

    def _spawn(self) -> None:
        thread = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with job._lock:
                if job._cancelled:
                    continue
                job.started = time.monotonic()
            try:
                job.value = job.fn(*job.args)
            except BaseException as error:  # noqa: B902
                # a hostile tool may raise anything; it ends its episode
                job.error = error
            with job._lock:
                job.finished = time.monotonic()
                cleanup = job._cleanup
            job._done.set()
            if cleanup is not None:  # written off: a replacement serves the queue now
                _quietly(cleanup)
                return

    def submit(self, fn, *args) -> Pending:
        job = Pending(fn, args, self.timeout_s)
        self._jobs.put(job)
        return job

    def write_off(self, job: Pending, then=None) -> bool:
        """`job`'s episode ended before the job did. True: a thread is still running it; that thread is
        written off and replaced (the pool keeps its size), and calls `then` (its environment's close) once
        the job returns, never if it never does. False: nothing runs it any more (a job still queued never
        will), so the caller may clean up at once."""
        with job._lock:
            running = bool(job.started) and not job.finished
            if running:
                job._cleanup = then or _nothing
            elif not job.started:
                job._cancelled = True
        if running:
            self.stuck += 1
            self._spawn()
        return running

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)


def _nothing() -> None:
    pass


def _quietly(cleanup) -> None:
    try:
        cleanup()
    except Exception:  # noqa: BLE001 — a broken close ends nothing more
        pass
