"""Learner throughput: forward + backward + AdamW step on realistic RL batches, as model FLOPs utilisation.

    python -m bench.train_step [--threads 2] [--steps 3] [--compile] [--completion-len 16] [--dtypes auto]
                               [--attention auto|segments|dense|matmuls|both|<way>,<way>...]
                               [--head-logits keep|both] [--freeze-embeddings as-default|both]
                               [--share-prefix as-default|both] [--groups 8]

A batch is the default run's: 8 prompts (`--groups`) of the arithmetic task x 8 completions of random length
(4-16 tokens), packed with the prompt once per group and the prompts' common prefix once a pass
(train.share_prefix); `--completion-len N` makes them N/4-N tokens long (passes of at most 4096 padded tokens,
train.micro_tokens' default). MFU = the model FLOPs of the tokens the passes computed per second (a shared
prefix's copies left out; 6 x parameters a token, less what frozen weights skip: trainer/policy.py
`train_flops_per_token`), over the peak of a matmul in the compute dtype measured in the same run. Each line
also gives the ceiling at this model's own matmul shapes (the step's projections timed alone): a narrow
model's matmuls cannot feed the bf16 units, so that ceiling, not the square-matmul peak, bounds what the step
could reach. Ends with `mfu=<fraction>` (bf16 autocast, against the square-matmul peak; fp32 on a CPU without
native bf16, where `--dtypes` defaults to fp32 alone). `--compile` also measures bf16 with
`train.compile=true` (the decoder stack through `torch.compile`: inductor fuses the element-wise work and
casts around the matmuls), prints its compile time and its speed against eager bf16 in the same run.
`--attention`: how packed rows attend: `auto` as the trainer does (rows of trainer.attention.MIN_ROW tokens or
more per segment, the CPU rows of a bf16 step under MATMUL_ROW through the dense mask as two matmuls, the
others through the dense mask in SDPA), `segments` every row with one call per prompt and per completion
(trainer/attention.py), `dense` every row through the [L, L] shared-prompt mask in SDPA, `matmuls` every row,
in any dtype, through that mask as two float32 matmuls and a softmax. Several, comma-separated (`both`:
`segments,dense`): per dtype one learner whose steps alternate between them on one batch, each way's s/step
and MFU; ends with `<way>_vs_<last way>=<the last way's median s/step over this one's>` for each other way
(bf16's, else fp32's).
`--head-logits both`: one learner (the head frozen, as by default), its steps alternating between three ways
the output head's backward gets its softmax (trainer/head.py): `direction` (the default: the forward makes the
rows' gradient direction from its softmax, the backward scales it), `keep` (the forward keeps the softmax
while it fits in KEEP_LOGITS_BYTES, as a trained head's does) and `recompute` (the backward recomputes the
logits), on the same batch; prints `keep_vs_recompute=` and ends with
`direction_vs_recompute=<recompute's median s/step over direction's>` (a shared VM drifts less within a run
than between runs). `--freeze-embeddings both`: two learners on the same batch, their steps alternating, with
the input embeddings (and the head tied to them) frozen and trained; ends with
`frozen_vs_trained=<trained's median s/step over frozen's>`. `--share-prefix both`: one learner, its steps
alternating between the prompts' common prefix computed once a pass and in every row, on the same batch; ends
with `shared_vs_whole=<every row's median s/step over shared's>`.
"""
import argparse
import socket
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

import algos
import trainer.attention
from bench.common import bench_dtypes, matmul_peak_flops, model_matmul_flops, task_prompts
from buffer.ring import Group
from models.loader import resolve
from runtime.schema import RolloutConfig, TrainConfig
from trainer.batch import pack
from trainer.freeze import train_flops_per_token
from trainer.head import _HeadLogprob
from trainer.learner import Learner

# --attention: each way's settings of trainer.attention (MIN_ROW: rows at least this long per segment;
# MATMUL_ROW and MATMUL_DTYPES: CPU rows under it, in a step computing in one of those, through the masked
# matmuls; the others through the dense mask in SDPA)
_AS_RUN = {name: getattr(trainer.attention, name) for name in ("MIN_ROW", "MATMUL_ROW", "MATMUL_DTYPES")}
ATTENTION = {"auto": {}, "segments": {"MIN_ROW": 0}, "dense": {"MIN_ROW": 1 << 62, "MATMUL_ROW": 0},
             "matmuls": {"MIN_ROW": 1 << 62, "MATMUL_ROW": 1 << 62,
                         "MATMUL_DTYPES": (torch.bfloat16, torch.float16, torch.float32)}}


def attend(way: str) -> None:
    """Packed rows attend `way` (ATTENTION) from now on."""
    for name, value in {**_AS_RUN, **ATTENTION[way]}.items():
        setattr(trainer.attention, name, value)


GROUPS = 8  # --groups


def batch(tokenizer, groups=None, k=8, seed=0, longest=16):
    """GROUPS prompts unless given, each with k completions of random length in [longest / 4, longest]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, prompt in enumerate(task_prompts(tokenizer, groups or GROUPS, seed)):
        lens = torch.randint(max(1, longest // 4), longest + 1, (k,), generator=g)
        ids = torch.randint(100, 40000, (k, longest), generator=g)
        out.append(Group(torch.tensor(prompt), ids, lens, torch.full((k, longest), -1.0),
                         torch.zeros(k, longest, dtype=torch.long),
                         torch.randint(0, 2, (k,), generator=g).float(), torch.zeros(k, dtype=torch.bool),
                         i, i, 0))
    return pack(out)


def measure(path, tokenizer, autocast: bool, steps: int, algo: str, compile: bool,
            longest: int = 16) -> tuple[float, int, int, object]:
    learner, data = _learner(path, tokenizer, autocast, algo, compile, longest)
    start = time.perf_counter()
    learner.step(data, 1)  # warm-up
    if compile:
        print(f"compile and first step: {time.perf_counter() - start:.0f} s "
              "(inductor caches it for later runs)")
    start = time.perf_counter()
    for step in range(steps):
        metrics = learner.step(data, step + 2)
    elapsed = (time.perf_counter() - start) / steps
    return elapsed, (metrics["train/tokens"], computed(metrics)), train_flops_per_token(learner.policy.lm), \
        learner.policy.lm.config


def computed(metrics: dict) -> int:
    """The tokens a learner step's passes computed: those trained on, less those left to one row's copy of the
    prompts' common prefix (train.share_prefix), as the run's perf/learner_mfu counts them."""
    return metrics["train/tokens"] - metrics["train/shared_prefix_tokens"]


def _learner(path, tokenizer, autocast: bool, algo: str, compile: bool, longest: int,
             freeze_embeddings: bool | None = None):
    """A learner as the default run's (train.freeze_embeddings too, unless given) on the bench's batch."""
    frozen = {} if freeze_embeddings is None else {"freeze_embeddings": freeze_embeddings}
    train = TrainConfig(batch_groups=8, micro_groups=8, micro_tokens=4096, lr=1e-6, grad_clip=1.0,
                        autocast="bfloat16" if autocast else "none", compile=compile, **frozen,
                        skip_tied_groups=False)  # every group's pass runs, a tie in the random rewards or not
    learner = Learner(model_path=path, train=train, algo=algos.get(algo).Config(),
                      rollout=RolloutConfig(group_size=8, max_new_tokens=longest, temperature=1.0))
    return learner, batch(tokenizer, longest=longest)


def _alternate(ways: dict, steps: int) -> dict:
    """Median s/step of each way (name -> a function of the step number that takes one), after a warm-up step
    each, `steps` rounds of one step each, in order then in reverse (a, b, b, a, ...), so that a drifting VM
    favours none."""
    names = list(ways)
    for name in names:
        ways[name](1)
    times = {name: [] for name in names}
    for round_ in range(steps):
        for name in names if round_ % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            ways[name](len(times[name]) + 2)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _alternate_settings(learner, data, settings: dict, steps: int) -> tuple[dict, dict]:
    """`_alternate` over one learner and batch: each setting (name -> a function that puts it in place) before
    each of its steps. Returns the medians and the last step's metrics."""
    last = {}

    def step_with(put):
        def step(n):
            put()
            last.update(learner.step(data, n))
        return step

    return _alternate({name: step_with(put) for name, put in settings.items()}, steps), last


def head_logits(path, tokenizer, autocast: bool, steps: int, algo: str, longest: int) -> dict:
    """Each way's median s/step (direction, keep, recompute), their steps alternating on one learner and
    batch."""
    learner, data = _learner(path, tokenizer, autocast, algo, False, longest)
    keep, direction = _HeadLogprob.KEEP_LOGITS_BYTES, _HeadLogprob.FROZEN_DIRECTION

    def way(frozen_direction: bool, keep_bytes: int):
        def put():
            _HeadLogprob.FROZEN_DIRECTION, _HeadLogprob.KEEP_LOGITS_BYTES = frozen_direction, keep_bytes
        return put

    try:
        medians, _ = _alternate_settings(learner, data, {"direction": way(True, keep),
                                                         "keep": way(False, keep),
                                                         "recompute": way(False, 0)}, steps)
    finally:
        _HeadLogprob.KEEP_LOGITS_BYTES, _HeadLogprob.FROZEN_DIRECTION = keep, direction
    print(f"{'bf16 autocast' if autocast else 'fp32':14s} head's softmax for the backward: " + ", ".join(
        f"{name} {s:.2f}" for name, s in medians.items()) + f" s/step ({steps} steps each, alternated, "
        f"{data.num_tokens} tokens)")
    return medians


def attention_ways(path, tokenizer, autocast: bool, steps: int, algo: str, longest: int,
                   ways: list[str]) -> dict:
    """Each --attention way's median s/step, their steps alternating on one learner and batch."""
    learner, data = _learner(path, tokenizer, autocast, algo, False, longest)
    try:
        medians, last = _alternate_settings(learner, data, {way: partial(attend, way) for way in ways}, steps)
    finally:
        attend("auto")
    flops, peak = train_flops_per_token(learner.policy.lm) * computed(last), \
        matmul_peak_flops(torch.bfloat16 if autocast else torch.float32)
    each = ", ".join(f"{way} {medians[way]:.2f} s/step (MFU {flops / medians[way] / peak:.1%})"
                     for way in ways)
    print(f"{'bf16 autocast' if autocast else 'fp32':14s} {each} ({steps} steps each, alternated, "
          f"{data.num_tokens} tokens in rows of {data.segments.shape[1]})")
    return medians


def freeze_embeddings(path, tokenizer, autocast: bool, steps: int, algo: str, longest: int) -> float:
    """Trained embeddings' median s/step over frozen ones' (train.freeze_embeddings), two learners' steps
    alternating on one batch."""
    data = batch(tokenizer, longest=longest)
    learners = {name: _learner(path, tokenizer, autocast, algo, False, longest, freeze_embeddings=frozen)[0]
                for name, frozen in (("frozen", True), ("trained", False))}
    medians = _alternate({name: lambda n, learner=learner: learner.step(data, n)
                          for name, learner in learners.items()},
                         steps)
    print(f"{'bf16 autocast' if autocast else 'fp32':14s} embeddings frozen {medians['frozen']:.2f} s/step, "
          f"trained {medians['trained']:.2f} s/step ({steps} steps each, alternated, "
          f"{data.num_tokens} tokens)")
    return medians["trained"] / medians["frozen"]


def share_prefix(path, tokenizer, autocast: bool, steps: int, algo: str, longest: int) -> float:
    """Whole rows' median s/step over a shared prefix's (train.share_prefix), their steps alternating on one
    learner and batch."""
    learner, data = _learner(path, tokenizer, autocast, algo, False, longest)
    share = partial(setattr, learner.policy, "share_prefix")
    medians, _ = _alternate_settings(learner, data,
                                     {"shared": partial(share, True), "whole": partial(share, False)}, steps)
    print(f"{'bf16 autocast' if autocast else 'fp32':14s} prompts' common prefix shared "
          f"{medians['shared']:.2f} s/step, in every row {medians['whole']:.2f} s/step ({steps} steps each, "
          f"alternated, {data.num_groups} groups, {data.num_tokens} tokens in rows of "
          f"{data.segments.shape[1]})")
    return medians["whole"] / medians["shared"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--algo", default="grpo")
    parser.add_argument("--compile", action="store_true", help="also bf16 as train.compile=true")
    parser.add_argument("--dtypes", default="auto",
                        help="fp32, bf16 (autocast) or both; auto: bf16 too where the CPU has it natively")
    parser.add_argument("--attention", default="auto",
                        help="rows: auto (as the trainer), segments, dense, matmuls, or several "
                             "comma-separated (compared; both = segments,dense)")
    parser.add_argument("--completion-len", type=int, default=16,
                        help="longest completion (the default run's 16; GSM8K's run to hundreds)")
    parser.add_argument("--head-logits", default="keep", choices=["keep", "both"],
                        help="both: steps alternating between the head's three ways to its "
                             "backward's softmax")
    parser.add_argument("--freeze-embeddings", default="as-default", choices=["as-default", "both"],
                        help="both: two learners' steps alternating, embeddings frozen and trained")
    parser.add_argument("--share-prefix", default="as-default", choices=["as-default", "both"],
                        help="both: steps alternating, the prompts' common prefix computed once "
                             "and in every row")
    parser.add_argument("--groups", type=int, default=8, help="groups (prompts) in the batch")
    args = parser.parse_args()
    global GROUPS
    GROUPS = args.groups
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    path = resolve("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    mfu = seconds_by = None
    dtypes = bench_dtypes(args.dtypes)
    if args.head_logits == "both":
        medians = [head_logits(path, tokenizer, name == "bf16", args.steps, args.algo, args.completion_len)
                   for name in dtypes][-1]
        dist.destroy_process_group()
        for way in ("keep", "direction"):
            print(f"{way}_vs_recompute={medians['recompute'] / medians[way]:.2f}")
        return
    for flag, compare, figure in (("freeze_embeddings", freeze_embeddings, "frozen_vs_trained"),
                                  ("share_prefix", share_prefix, "shared_vs_whole")):
        if getattr(args, flag) == "both":
            ratios = [compare(path, tokenizer, name == "bf16", args.steps, args.algo, args.completion_len)
                      for name in dtypes]
            dist.destroy_process_group()
            print(f"{figure}={ratios[-1]:.2f}")
            return
    ways = (["segments", "dense"] if args.attention == "both"
            else list(dict.fromkeys(args.attention.split(","))))
    if not set(ways) <= set(ATTENTION):
        parser.error(f"--attention: each of {', '.join(ways)} must be one of "
                     f"{', '.join(ATTENTION)} (or both)")
    if len(ways) > 1:
        medians = [attention_ways(path, tokenizer, name == "bf16", args.steps, args.algo,
                                  args.completion_len, ways)
                   for name in dtypes][-1]
        dist.destroy_process_group()
        for way in ways[:-1]:
            print(f"{way}_vs_{ways[-1]}={medians[ways[-1]] / medians[way]:.2f}")
        return
    attend(ways[0])
    cases = ([(False, torch.float32, False)] * ("fp32" in dtypes)
             + [(True, torch.bfloat16, False)] * ("bf16" in dtypes)
             + [(True, torch.bfloat16, True)] * args.compile)
    for autocast, dtype, compiled in cases:
        peak = matmul_peak_flops(dtype)
        seconds, (trained, tokens), flops_per_token, config = measure(
            path, tokenizer, autocast, args.steps, args.algo, compiled, args.completion_len)
        ceiling = model_matmul_flops(config, tokens, dtype)
        achieved = flops_per_token * tokens / seconds
        name = ("bf16 autocast" if autocast else "fp32") + (" compiled" if compiled else "")
        print(f"{name:22s} {trained} tokens/step ({tokens} computed)  {seconds:.2f} s/step  "
              f"{trained / seconds:.0f} tokens/s  "
              f"{achieved / 1e9:.0f} GFLOP/s  peak {peak / 1e9:.0f} GFLOP/s  MFU {achieved / peak:.1%}  "
              f"({args.threads} threads, algo={args.algo}); this model's matmuls alone: {ceiling / 1e9:.0f} "
              f"GFLOP/s = {ceiling / peak:.0%} of peak, the step reaches {achieved / ceiling:.0%} of that")
        if compiled:
            print(f"compiled vs eager bf16: {seconds_by / seconds:.2f}x")
        else:
            # the last line: eager bf16 (fp32 without it), as a run
            mfu, seconds_by = achieved / peak, seconds
    dist.destroy_process_group()
    if mfu is not None:
        print(f"mfu={mfu:.3f}")


if __name__ == "__main__":
    main()
