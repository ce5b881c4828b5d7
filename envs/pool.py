"""Environment steps beside the engine: a pool of daemon threads, each step with a deadline.

Generation never waits for an environment. The rollout worker submits `env.step(text)` and polls; a step that
passes its deadline is abandoned (its episode ends `env_timeout`) and its thread is written off: a thread
cannot be killed, so the pool starts another in its place and counts the stuck ones. Threads are daemons, so a
step that never returns cannot hold the process at exit. Threads suit trusted pure-Python environments and
waits that use no core (a remote tool, a sleep); anything that runs model-written code goes through the
sandbox (rewards/sandbox.py) from inside its step, which bounds it in time and memory.
"""
import queue
import threading
import time


class Pending:
    """One submitted call: done() once it returned or raised, or its deadline passed (timed_out)."""

    def __init__(self, fn, args, deadline: float):
        self.fn, self.args, self.deadline = fn, args, deadline
        self.started = self.finished = 0.0  # time.monotonic() at its start and its end (0: not yet)
        self.value, self.error, self.timed_out = None, None, False
        self._done = threading.Event()

    def done(self) -> bool:
        if not self._done.is_set() and time.monotonic() > self.deadline:
            self.timed_out = True
            return True
        return self._done.is_set()

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
        self.stuck = 0  # threads written off with a step that passed its deadline
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
            if time.monotonic() > job.deadline:  # waited in the queue past its deadline: never run it
                job._done.set()
                continue
            job.started = time.monotonic()
            try:
                job.value = job.fn(*job.args)
            except BaseException as error:  # noqa: B902
                # a hostile tool may raise anything; it ends its episode
                job.error = error
            job.finished = time.monotonic()
            job._done.set()

    def submit(self, fn, *args) -> Pending:
        job = Pending(fn, args, time.monotonic() + self.timeout_s)
        self._jobs.put(job)
        return job

    def write_off(self, job: Pending) -> None:
        """`job` timed out while a thread ran it: replace that thread, so the pool keeps its size."""
        if job.started and not job.finished:
            self.stuck += 1
            self._spawn()

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
