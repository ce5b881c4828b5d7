"""One contract per written interface, run over every implementation: the engine (engines.base.Engine), the
weight path (engines.base.WeightPath), the trainer placement (trainer.policy.Placement), the evaluator
(evaluate.Evaluator) and the device plan (launch.plan.Plan). The GPU implementations run on the CPU here, with
the fakes of tests/gpu_fakes.py standing in for SGLang and CUDA IPC."""
import functools
import multiprocessing as mp
import threading
import time
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import tasks
from engines.base import Completion, Engine, EngineSpec, Request, SamplingParams, WeightPath
from evaluate import EngineEvaluator, EvalChannel, Evaluator, eval_slot
from launch.gpu import GPUPlan
from launch.layout import plan_layout
from launch.plan import CPUPlan, Plan, free_port
from runtime.schema import EvalConfig, RewardConfig
from runtime.setup import EvalSpec
from runtime.shared import StopFlag
from tests.gpu_fakes import FakeBackend, FakeSGLang, bytes_payloads
from tests.test_trainer import _groups
from trainer.batch import pack
from trainer.gpu_policy import GPUPlacement
from trainer.policy import CPUPlacement, Placement, TokenLogprobs

# ---- Engine: engines/builtin.py BuiltinEngine, engines/sglang.py SGLangEngine ----


def _cpu_engine(model_dir):
    from engines.builtin import BuiltinEngine

    return BuiltinEngine(AutoModelForCausalLM.from_pretrained(model_dir), max_batch=8, max_len=64, seed=0)


def _sglang_engine(model_dir):
    from engines.sglang import SGLangEngine

    return SGLangEngine(FakeBackend(chunk=64), max_batch=8)  # chunk >= budget: requests finish


def _simulated_engine(model_dir):
    from engines.simulated import SimulatedEngine

    return SimulatedEngine({}, vocab_size=64, max_batch=8, step_s=0.0)  # bench/ray_scaling.py's stand-in


ENGINES = {"cpu": _cpu_engine, "sglang": _sglang_engine, "simulated": _simulated_engine}


@pytest.mark.parametrize("make", ENGINES.values(), ids=ENGINES.keys())
def test_engine_contract(make, tiny_model_dir):
    engine = make(tiny_model_dir)
    assert isinstance(engine, Engine)
    stop_at = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=(2,))
    requests = [Request(i, [5 + i, 6, 7], stop_at if i % 2 else SamplingParams(0.0, 1.0, 4))
                for i in range(5)]

    engine.set_version(3)
    done = engine.generate(requests)
    assert [c.request_id for c in done] == [r.request_id for r in requests]  # in the requests' order
    for request, c in zip(requests, done):
        assert isinstance(c, Completion) and c.prompt_ids == request.prompt_ids
        n = len(c.token_ids)
        assert 1 <= n <= request.params.max_new_tokens and len(c.logprobs) == len(c.versions) == n
        assert all(v == 3 for v in c.versions) and all(lp <= 0 for lp in c.logprobs)
        stopped = c.token_ids[-1] in request.params.stop_token_ids
        assert c.finish_reason == ("stop" if stopped else "length")
        assert stopped or n == request.params.max_new_tokens

    # Driven by hand: what is added is waiting or running until a step returns it, once.
    for r in requests:
        engine.add(r)
    assert engine.num_waiting() + engine.num_running() == 5 and engine.free_slots() <= 8
    with pytest.raises(ValueError, match="idle engine"):
        engine.generate(requests)
    finished = []
    for _ in range(1000):
        finished += engine.step()
        if engine.num_waiting() + engine.num_running() == 0:
            break
    assert sorted(c.request_id for c in finished) == list(range(5)) and engine.free_slots() == 8
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add(Request(9, [], stop_at))


SPECS = {"cpu": ("engines.builtin", "BuiltinEngineSpec"), "sglang": ("engines.sglang", "SGLangSpec")}


@pytest.mark.parametrize("name", SPECS)  # the engines that take buckets
def test_weight_receipt_contract(name, tiny_model_dir):
    """How a version arrives, the same for every engine: begin_weights, a bucket in the form its spec's
    bucket_payloads made, adopt_weights; tokens sampled before keep the old version, those after get the new.
    Requests in flight survive it (the built-in engine continues them, SGLang resubmits them)."""
    import importlib

    from engines.buckets import BucketMessage, plan_buckets, send_buckets

    engine = ENGINES[name](tiny_model_dir)
    module, cls = SPECS[name]
    spec = getattr(importlib.import_module(module), cls)
    assert isinstance(engine.weight_tensors(), dict)
    named = [(n, t.detach().clone()) for n, t in engine.weight_tensors().items()][:2] \
        or [("w", torch.zeros(4))]
    payloads = spec.bucket_payloads if name == "cpu" else bytes_payloads
    buckets = plan_buckets([(n, t.shape, t.dtype) for n, t in named], 1 << 20)
    messages = []
    send_buckets(named, buckets, "cpu",
                 lambda i, flat, slots: messages.append(BucketMessage(7, i, i == len(buckets) - 1, slots,
                                                                      payloads(flat, slots, 1))))
    engine.set_version(6)
    engine.add(Request(0, [5, 6, 7], SamplingParams(1.0, 1.0, 8)))
    finished = engine.step()
    finished += engine.begin_weights()
    for message in messages:
        engine.load_bucket(message)
    finished += engine.adopt_weights(7)
    assert engine.version == 7
    for _ in range(1000):
        if finished or engine.num_waiting() + engine.num_running() == 0:
            break
        finished += engine.step()
    (done,) = finished
    assert done.versions[0] == 6 and set(done.versions) <= {6, 7}


# ---- WeightPath: engines/weights.py WeightStore, engines/weight_sync.py GPUWeights ----

def _weight_store(model_dir):
    """The CPU plan's path, into a built-in engine; returns (path, engine, the engine's weights by name)."""
    from engines.weights import WeightStore

    engine = _cpu_engine(model_dir)
    store = WeightStore.for_model(AutoModelForCausalLM.from_pretrained(model_dir))
    return store, engine, lambda: {n: t.float() for n, t in engine.weight_tensors().items()}


def _gpu_weights(model_dir):
    """The GPU plan's path (queues and buckets; bytes instead of CUDA IPC handles), into an SGLang engine."""
    from engines.buckets import WeightChannel
    from engines.sglang import SGLangEngine
    from engines.weight_sync import GPUWeights

    engine = SGLangEngine(FakeBackend(), max_batch=256)
    path = GPUWeights(WeightChannel(1, mp.get_context("spawn")), [1], bytes_payloads, "ipc", 1 << 16,
                      torch.bfloat16)

    def loaded():
        return {n: t.float() for names, _, _ in engine.backend.loaded for n, t in names.items()}

    return path, engine, loaded


def _gpu_weights_into_builtin(model_dir):
    """The GPU plan's path into a built-in engine: buckets as tensors (shared memory here, CUDA IPC on a GPU),
    in the engine's dtype."""
    from engines.buckets import WeightChannel
    from engines.builtin import BuiltinEngineSpec
    from engines.weight_sync import GPUWeights

    engine = _cpu_engine(model_dir)
    path = GPUWeights(WeightChannel(1, mp.get_context("spawn")), [1], BuiltinEngineSpec.bucket_payloads,
                      "ipc", 1 << 16, torch.float32)
    return path, engine, lambda: {n: t.float() for n, t in engine.weight_tensors().items()}


WEIGHT_PATHS = {"shared_memory": _weight_store, "gpu_buckets": _gpu_weights,
                "gpu_buckets_builtin": _gpu_weights_into_builtin}


@pytest.mark.parametrize("make", WEIGHT_PATHS.values(), ids=WEIGHT_PATHS.keys())
def test_weight_path_contract(make, tiny_model_dir):
    """publish(version) on the trainer side; the follower's sync() between steps then holds exactly those
    weights under that version, in the engine's dtype. A non-lead rank's publish ships nothing."""
    path, engine, engine_weights = make(tiny_model_dir)
    assert isinstance(path, WeightPath)
    policy = TokenLogprobs(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)
    trained = {n.removeprefix("lm."): t.detach().clone() for n, t in policy.state_dict().items()}
    sync = path.follower(engine, 0)
    assert sync() == [] and engine.version == 0  # nothing published yet

    publish = path.publisher(policy, True, StopFlag())
    shipping = threading.Thread(target=publish, args=(list(trained.items()), 1))
    shipping.start()  # the GPU path waits for every engine to load each bucket: the follower runs meanwhile
    deadline = time.time() + 60
    while engine.version < 1 and time.time() < deadline:
        sync()
    shipping.join()
    assert engine.version == 1
    got = engine_weights()
    assert got and set(got) <= set(trained)
    for name, tensor in got.items():
        assert torch.allclose(tensor, trained[name], atol=1e-2, rtol=1e-2), name  # bf16 on the GPU path
    assert not all(torch.allclose(tensor, trained[name] - 0.01, atol=1e-3) for name, tensor in got.items())

    # another rank's: walks, ships nothing
    path.publisher(policy, False, StopFlag())(iter(trained.items()), 2)
    assert sync() == [] and engine.version == 1
    if hasattr(path, "channel"):
        path.channel.close()


# ---- Placement: trainer/policy.py CPUPlacement, trainer/gpu_policy.py GPUPlacement ----

PLACEMENTS = {"cpu": CPUPlacement(), "gpu_on_cpu": GPUPlacement(gpu=0, device_type="cpu")}


@pytest.mark.parametrize("placement", PLACEMENTS.values(), ids=PLACEMENTS.keys())
def test_placement_contract(placement, tiny_model_dir):
    """A rank joins its group; `load` gives the policy on `device`, whose forward maps a packed batch to one
    logprob per completion token, equal across placements; frozen gives a reference without gradients."""
    assert isinstance(placement, Placement)
    placement.init_process_group(0, 1, free_port())
    try:
        policy = placement.load(tiny_model_dir, 1)
        reference = placement.load(tiny_model_dir, 1, frozen=True)
        batch = pack(_groups())
        inputs = (batch.input_ids, batch.position_ids, batch.segments, batch.gather, batch.targets, 1.0)
        with torch.no_grad():
            logprobs = policy(*(t.to(placement.device) if torch.is_tensor(t) else t for t in inputs))
            expected = TokenLogprobs(AutoModelForCausalLM.from_pretrained(tiny_model_dir))(*inputs)
        assert logprobs.shape == batch.targets.shape and logprobs.device.type == placement.device.type
        mask = batch.mask.bool()
        # the GPU one computes in bf16
        assert torch.allclose(logprobs.float().cpu()[mask], expected[mask], atol=0.1)
        assert any(p.requires_grad for p in policy.parameters())
        assert not any(p.requires_grad for p in reference.parameters())
    finally:
        dist.destroy_process_group()


# ---- Evaluator: evaluate.EngineEvaluator (CPU plan), evaluate.EvalChannel (GPU plan) ----

SPEC = EvalSpec(EvalConfig(k=2), RewardConfig(workers=0), max_new_tokens=4, stop_ids=(2,), seed=0)


class TableEngine:
    """An Engine whose answers depend only on the request id and the version of its weights: the greedy sample
    of test example i is right when i % 3 == 0, sample m when (i + m) % 2 == 0; all wrong before version 1."""

    def __init__(self, tokenizer, test):
        self.tokenizer, self.test, self.version = tokenizer, test, 0
        self.waiting, self.requested = [], []

    def set_version(self, version):
        self.version = version

    def add(self, request):
        self.waiting.append(request)
        self.requested.append(request.request_id)

    def step(self):
        out, self.waiting = [self._answer(r) for r in self.waiting], []
        return out

    def generate(self, requests):
        for r in requests:
            self.add(r)
        return self.step()

    def num_running(self):
        return 0

    def num_waiting(self):
        return len(self.waiting)

    def free_slots(self):
        return 64

    def _answer(self, request):
        i, m = eval_slot(request.request_id, SPEC.eval.k)
        right = self.version >= 1 and (i % 3 == 0 if m == 0 else (i + m) % 2 == 0)
        ids = self.tokenizer.encode(self.test[i].answer if right else "no", add_special_tokens=False)
        return Completion(request.request_id, request.prompt_ids, ids, [0.0] * len(ids),
                          [self.version] * len(ids), "stop")


class TableEngineSpec:
    def __init__(self, engine):
        self.engine = engine

    @contextmanager
    def open(self, weights_path, seed):
        yield self.engine


class VersionPath:
    """A weight path that carries only the version number."""

    def __init__(self):
        self.version = 0

    def publisher(self, policy, lead, stop):
        return lambda tensors, version: setattr(self, "version", version)

    def follower(self, engine, index):
        def sync():
            engine.set_version(max(engine.version, self.version))
            return []
        return sync


def _on_own_engine(tokenizer, task):
    engine = TableEngine(tokenizer, task.test)
    return EngineEvaluator(TableEngineSpec(engine)), [engine], None


def _on_worker_engines(tokenizer, task, workers=3):
    """Three rollout workers' loops, as threads: each polls its part of the channel and steps its engine."""
    channel, stop = EvalChannel(workers, mp.get_context("spawn")), threading.Event()
    engines = [TableEngine(tokenizer, task.test) for _ in range(workers)]

    def worker(w, path):
        part = channel.worker_part(w, task, tokenizer, SPEC, pool)
        sync = path.follower(engines[w], w)
        while not stop.is_set():
            sync()
            for request in part.poll(engines[w].version):
                engines[w].add(request)
            for done in engines[w].step():
                assert part.owns(done)
                part.add(done)
            time.sleep(0.002)

    from rewards.pool import RewardPool

    pool = RewardPool(task.reward, 0, 5.0)
    return channel, engines, (worker, stop, pool)


@pytest.mark.parametrize("make", [_on_own_engine, _on_worker_engines], ids=["own_engine", "worker_engines"])
def test_evaluator_contract(make, tokenizer_dir):
    """Rank 0 publishes version 1, then evaluates it: the metrics are those of version 1 (not of the initial
    weights) and the same wherever it runs, every test example scored once."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    task = tasks.get("arithmetic").build(tasks.get("arithmetic").Config(test_size=9), 0)
    evaluator, engines, workers = make(tokenizer, task)
    assert isinstance(evaluator, Evaluator)
    path = VersionPath()
    threads = []
    if workers is not None:
        worker, stop, pool = workers
        threads = [threading.Thread(target=worker, args=(w, path)) for w in range(len(engines))]
        for t in threads:
            t.start()
    try:
        with evaluator.open(tokenizer_dir, path, task, SPEC) as evaluate:
            path.publisher(None, True, None)([], 1)
            metrics = evaluate(1, StopFlag())
    finally:
        if workers is not None:
            stop.set()
            for t in threads:
                t.join()
            pool.close()
            evaluator.close()
    n = len(task.test)
    assert metrics["eval_examples"] == n
    assert metrics["eval_pass@1"] == sum(i % 3 == 0 for i in range(n)) / n
    assert metrics["eval_pass@2"] == 1.0  # one of samples 1, 2 has (i + m) even
    assert metrics["eval_sample_reward"] == 0.5
    examples = sorted(eval_slot(r, SPEC.eval.k)[0] for e in engines
                      for r in e.requested if eval_slot(r, 2)[1] == 0)
    assert examples == list(range(n))


def test_the_cpu_plan_s_evaluator_holds_an_engine_only_while_it_evaluates(tokenizer_dir):
    """EngineEvaluator opens its engine for each evaluation and closes it after, so rank 0 holds no second
    copy of the weights (nor their blocked copies, nor a KV cache) while it trains."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    task = tasks.get("arithmetic").build(tasks.get("arithmetic").Config(test_size=9), 0)
    engine, opened, held = TableEngine(tokenizer, task.test), [], []

    class CountingSpec:
        @contextmanager
        def open(self, weights_path, seed):
            opened.append(seed)
            held.append(engine)
            try:
                yield engine
            finally:
                held.pop()

    path = VersionPath()
    with EngineEvaluator(CountingSpec()).open(tokenizer_dir, path, task, SPEC) as evaluate:
        assert not opened  # nothing before the first evaluation
        for version in (1, 2):
            path.publisher(None, True, None)([], version)
            metrics = evaluate(version, StopFlag())
            assert not held and engine.version == version
            assert metrics["eval_pass@1"] == sum(i % 3 == 0 for i in range(len(task.test))) / len(task.test)
    assert opened == [SPEC.seed, SPEC.seed]


# ---- Plan: launch/plan.py CPUPlan, launch/gpu.py GPUPlan ----

PLANS = {"cpu": CPUPlan(rollout_workers=2, trainer_ranks=1, max_restarts=3, engine_kind="builtin"),
         "gpu_on_cpu": GPUPlan(plan_layout(2), "ipc", 512, False, "sglang", "bfloat16", "cpu",
                               serialize=bytes_payloads,
                               engine_backend=functools.partial(FakeSGLang, "/tmp"))}


@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_plan_contract(plan, tiny_model_dir):
    """Every piece a plan gives the launcher is of its role (tests/test_gpu_path.py runs a GPU plan's pieces
    across real processes, tests/test_train_e2e.py the CPU plan's)."""
    assert isinstance(plan, Plan)
    assert plan.rollout_workers >= 1 and plan.trainer_ranks >= 1 and plan.max_restarts >= 0
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir))
    weights = plan.weights(meta)
    pieces = [(weights, WeightPath), (plan.evaluator(32, "float32"), Evaluator)]
    pieces += [(plan.engine(w, 16, 32, "float32"), EngineSpec) for w in range(plan.rollout_workers)]
    pieces += [(plan.placement(r), Placement) for r in range(plan.trainer_ranks)]
    for piece, role in pieces:
        assert isinstance(piece, role), (piece, role)
    for piece, _ in pieces:
        if hasattr(piece, "close"):
            piece.close()
        elif hasattr(getattr(piece, "channel", None), "close"):
            piece.channel.close()


def test_every_engine_s_spec_says_what_it_can_do():
    """The plans ask these (launch/plan.py engine_kind, launch/gpu.py gpu_plan), never an engine's name."""
    from engines import ENGINES
    from engines.base import EngineSpec

    for name in ENGINES.names():
        spec = ENGINES.get(name).SPEC
        assert isinstance(spec, EngineSpec), name
        assert set(spec.plans) <= {"cpu", "gpu"} and spec.plans, name
        assert all(isinstance(getattr(spec, flag), bool) for flag in ("tensor_parallel", "nccl_weights",
                                                                         "stop_strings")), name
        assert (spec.requires is None) == (spec.install == ""), name


def test_auto_takes_the_preferred_engine_a_plan_can_run_and_says_when_it_settles(monkeypatch):
    from engines.builtin import BuiltinEngineSpec
    from launch import plan

    monkeypatch.setattr(BuiltinEngineSpec, "preference", 2)  # now preferred over SGLang everywhere
    assert plan.engine_kind("auto", "gpu") == ("builtin", None)
    monkeypatch.setattr(BuiltinEngineSpec, "preference", 0)
    monkeypatch.setattr(plan.importlib.util, "find_spec", lambda name: None)
    kind, notice = plan.engine_kind("auto", "gpu")
    assert kind == "builtin" and "sglang is not installed" in notice
    monkeypatch.setattr(BuiltinEngineSpec, "plans", ("gpu",))
    with pytest.raises(ValueError, match=r"rollout.engine=builtin needs the GPU plan"):
        plan.engine_kind("builtin", "cpu")
