"""Where a step's metrics go: metrics.jsonl always, TensorBoard or Weights & Biases on request, the console.

    logger = MetricsLogger(run_dir, "tensorboard", steps=30, progress=True, config=resolved_config)
    logger.log({"step": 1, "reward_mean": 0.4, ...})
    logger.close()
"""
import json
import math
import netrc
import numbers
import os
import sys
import time
from importlib.util import find_spec
from urllib.parse import urlparse

BACKENDS = {"none": None, "tensorboard": "tensorboard", "wandb": "wandb"}  # backend -> package it needs


def check_backend(backend: str) -> None:
    """Fail in one line, before any process starts, if `logger=` is unknown or its package is missing."""
    if backend not in BACKENDS:
        raise ValueError(f"config key 'logger' must be one of {', '.join(BACKENDS)} (got {backend!r})")
    package = BACKENDS[backend]
    if package is not None and find_spec(package) is None:
        raise ValueError(f"logger={backend} needs the {package} package: pip install {package}")


WAIT_SHOWN_S = 10.0  # the console says the trainer is waiting for data once it has waited this long

class MetricsLogger:
    """One row per step (a trained batch, one policy version) to `<run_dir>/metrics.jsonl` (appended, so a
    resumed run keeps its earlier rows), to a backend, and to the console.

    backend: "none"; "tensorboard" (event files in `<run_dir>/tensorboard`, one scalar per numeric key;
    `tensorboard --logdir <run_dir>`); "wandb" (a W&B run under `<run_dir>/wandb`, project $WANDB_PROJECT or
    "ringrl", named after the run dir). The W&B mode is $WANDB_MODE when set; otherwise "online" when an API
    key is at hand ($WANDB_API_KEY or a ~/.netrc entry from `wandb login`) and "offline" when not, so a run
    never blocks on a login prompt or the network (`wandb sync <run_dir>/wandb/offline-run-*` uploads it
    later). start_step: the steps already done (resuming from checkpoint step_N: N, after
    `truncate_metrics(path, N)`); the bar starts there, TensorBoard hides the old events after it, and W&B
    starts a new run.

    Console (progress=True): a tqdm bar on stderr when stderr is a terminal; otherwise
    (a log file, a pipe, CI) one plain line at most every `line_every_s` seconds, and always for the first and
    last step.
    """

    def __init__(self, run_dir: str, backend: str = "none", steps: int = 0, progress: bool = True,
                 config: dict | None = None, start_step: int = 0, line_every_s: float = 10.0):
        check_backend(backend)
        self.run_dir = run_dir
        self.sink = _SINKS[backend](run_dir, config or {}, start_step) if backend != "none" else None
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        self.console = _Console(steps, start_step, line_every_s) if progress else None

    def log(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.sink is not None:
            values = {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, numbers.Real)}
            self.sink.log(values, int(row["step"]))
        if self.console is not None:
            self.console.update(row)

    def waiting(self, seconds: float, have: int, need: int) -> None:
        """Between steps: the trainer has waited `seconds` for fresh groups and has `have` of the `need`.
        Shown on the console after WAIT_SHOWN_S, so that a slow run and a stuck one look different."""
        if self.console is not None and seconds >= WAIT_SHOWN_S:
            self.console.waiting(f"waiting for data {seconds:.0f} s ({have}/{need} groups)")

    def close(self) -> None:
        """Flush and release everything; safe to call twice (e.g. from a `finally` after an error)."""
        if self.console is not None:
            self.console.close()
            self.console = None
        if self.sink is not None:
            self.sink.close()
            self.sink = None
        if not self.file.closed:
            self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def truncate_metrics(path: str, last_step: int) -> int:
    """Keep the rows of `path` with step <= last_step (and drop a line cut short by a crash), atomically.
    For resuming from the checkpoint of `last_step`. Returns the number of rows kept."""
    if not os.path.exists(path):
        return 0
    kept = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and row.get("step", math.inf) <= last_step:
                kept.append(json.dumps(row) + "\n")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(kept)


class _TensorBoard:
    def __init__(self, run_dir: str, config: dict, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides the events a crashed run wrote after the checkpoint it resumes from
        purge = start_step + 1 if start_step else None
        self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=purge)
        if config:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", start_step)

    def log(self, values: dict, step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a step takes seconds; a crash should not lose the last two minutes

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, run_dir: str, config: dict, start_step: int):
        import wandb

        self.wandb = wandb
        # console="off": W&B must not wrap stdout/stderr (the progress bar and the launcher own them)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "ringrl"), dir=run_dir,
                              mode=wandb_mode(), name=os.path.basename(os.path.normpath(run_dir)),
                              config=config, settings=wandb.Settings(console="off"))

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
        # stops the wandb-core service process, which atexit does not in a spawned child
        self.wandb.teardown()


def wandb_mode() -> str:
    """$WANDB_MODE if set; else online with an API key at hand ($WANDB_API_KEY or ~/.netrc), else offline."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return "online" if netrc.netrc(os.environ.get("NETRC")).authenticators(host) else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


_SINKS = {"tensorboard": _TensorBoard, "wandb": _Wandb}


class _Console:
    """A tqdm bar on a terminal; plain lines elsewhere, where a bar's carriage returns would pile up."""

    def __init__(self, steps: int, start_step: int, line_every_s: float):
        self.steps, self.every_s, self.last_line = steps, line_every_s, -math.inf
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=steps, initial=start_step, desc="ringrl", unit="step", mininterval=1.0)

    def update(self, row: dict) -> None:
        fields = _fields(row)
        if self.bar is not None:
            # the bar has its own
            self.bar.set_postfix({k: v for k, v in fields if k != "time"}, refresh=False)
            self.bar.update(1)
            return
        now = time.monotonic()
        first_or_last = self.last_line == -math.inf or row.get("step") == self.steps
        if first_or_last or now - self.last_line >= self.every_s:
            self.last_line = now
            head = f"step {row.get('step')}/{self.steps}"
            print("  ".join([head] + [f"{k} {v}" for k, v in fields]), file=sys.stderr, flush=True)

    def waiting(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text)  # the next step's figures replace it
            return
        now = time.monotonic()
        if now - self.last_line >= self.every_s:
            self.last_line = now
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _fields(row: dict) -> list[tuple[str, str]]:
    """The few figures worth watching, formatted; keys a row lacks (e.g. eval only) are left out."""
    spec = [("reward", "reward_mean", "{:.3f}"), ("stale", "staleness_mean", "{:.2f}"),
            ("gen_tok/s", "gen_tokens_per_s", "{:.0f}"), ("train_tok/s", "train_tokens_per_s", "{:.0f}"),
            ("pass@1", "eval_pass@1", "{:.3f}"), ("time", "time_s", "{:.0f}s")]
    return [(name, fmt.format(row[key])) for name, key, fmt in spec if isinstance(row.get(key), numbers.Real)]
