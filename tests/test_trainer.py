"""The trainer's maths: shared-prompt packing equals K separate sequences, in values and gradients."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from buffer.ring import Group
from trainer.batch import PAD, micro_batches, pack
from trainer.policy import TokenLogprobs


def _groups(k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [random_group(g, index, p, k) for index, p in enumerate((5, 9))]


def random_group(g: torch.Generator, index: int, prompt_len: int, k: int, rewards: list[float] | None = None,
                 behaviour: bool = False) -> Group:
    """K random completions of 1-6 tokens after a random prompt; random rewards unless given, and behaviour
    logprobs in (-1, 0] with `behaviour` (else 0)."""
    lens = torch.randint(1, 7, (k,), generator=g)
    ids = torch.zeros(k, 6, dtype=torch.long)
    for i in range(k):
        ids[i, : lens[i]] = torch.randint(3, 1000, (int(lens[i]),), generator=g)
    prompt = torch.randint(3, 1000, (prompt_len,), generator=g)
    logprobs = -torch.rand(k, 6, generator=g) if behaviour else torch.zeros(k, 6)
    return Group(prompt_ids=prompt, completion_ids=ids, completion_lens=lens, logprobs=logprobs,
                 versions=torch.zeros(k, 6, dtype=torch.long),
                 rewards=torch.rand(k, generator=g) if rewards is None else torch.tensor(rewards),
                 truncated=torch.zeros(k, dtype=torch.bool), prompt_index=index, group_id=index, worker_id=0)


def _separate(model, groups, temperature):
    """Reference: every completion run after its prompt on its own, the textbook way."""
    out = []
    for g in groups:
        for i in range(g.completion_ids.shape[0]):
            c = g.completion_ids[i, : int(g.completion_lens[i])]
            ids = torch.cat([g.prompt_ids, c])[None]
            logits = model(input_ids=ids).logits[0, len(g.prompt_ids) - 1 : -1].float() / temperature
            out.append(logits.log_softmax(-1).gather(-1, c[:, None]).squeeze(-1))
    return out


def test_packed_logprobs_and_grads_equal_separate_sequences(tiny_model_dir):
    check_packed_equals_separate(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))


def test_rows_that_share_a_prompt_prefix_equal_separate_sequences(tiny_model_dir):
    """The prompts' common prefix kept once in the batch (trainer/batch.py hoist_prefix) against the textbook
    way."""
    groups = _groups()
    for g in groups[1:]:
        g.prompt_ids[:4] = groups[0].prompt_ids[:4]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    seen = []
    model.get_input_embeddings().register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    check_packed_equals_separate(model, groups)
    # rows of 18 and 20 tokens: the first keeps the prefix, the second drops it, so the pass is 18 tokens long
    assert (pack(groups).segments != PAD).sum(1).tolist() == [18, 20] and seen[0] == 18


def check_packed_equals_separate(model, groups: list | None = None) -> dict:
    """The packed forward's logprobs and gradients equal those of every completion run on its own; returns the
    packed pass's gradients."""
    policy = TokenLogprobs(model)
    groups = groups or _groups()
    batch = pack(groups)
    packed = policy(batch.input_ids, batch.position_ids, batch.segments, batch.gather, batch.targets, 0.7)
    (packed * batch.mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    reference = _separate(model, groups, 0.7)
    sum(r.sum() for r in reference).backward()
    for row, ref in enumerate(reference):
        assert torch.allclose(packed[row, : len(ref)], ref, atol=1e-5), row
        assert batch.mask[row].sum() == len(ref)
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-5, rtol=1e-4), name
    return grads


def test_micro_batch_slices_keep_whole_groups(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    policy = TokenLogprobs(model)
    batch = pack(_groups())
    with torch.no_grad():
        full = policy(batch.input_ids, batch.position_ids, batch.segments, batch.gather, batch.targets, 1.0)
        second = batch.groups(1, 2)
        part = policy(second.input_ids, second.position_ids, second.segments, second.gather,
                      second.targets, 1.0)
    k = batch.group_size
    t = part.shape[1]
    assert torch.allclose(full[k:, :t] * batch.mask[k:, :t], part * second.mask, atol=1e-5)
    assert torch.equal(second.rewards, batch.rewards[k:])


# ---- micro-batches by token budget (trainer.batch.micro_batches) ----

def test_short_rows_go_through_in_one_pass():
    assert micro_batches([150] * 8, 1, 8, 4096) == [[(0, 8)]]  # the default run: unchanged by the budget
    # micro_groups still caps a pass
    assert micro_batches([150] * 8, 1, 3, 4096) == [[(0, 3), (3, 6), (6, 8)]]


def test_the_token_budget_counts_each_pass_padded_to_its_longest_row():
    assert micro_batches([1500] * 8, 1, 8, 4096) == [[(0, 2), (2, 4), (4, 6), (6, 8)]]
    assert micro_batches([100, 3000, 100, 100], 1, 8, 4096) == [[(0, 1), (1, 2), (2, 4)]]
    # over the budget alone: still trained
    assert micro_batches([5000, 100], 1, 8, 4096) == [[(0, 1), (1, 2)]]
    assert micro_batches([1500] * 8, 1, 8, 0) == [[(0, 8)]]  # 0: no budget


def test_the_default_budget_is_settled_by_device():
    """train.micro_tokens=-1 (the schema's default): 4096 on the CPU, 65536 on a GPU; a set value stays."""
    from runtime.schema import TrainConfig
    from trainer.batch import pass_tokens

    assert TrainConfig().micro_tokens == -1
    assert (pass_tokens(-1, "cpu"), pass_tokens(-1, "cuda")) == (4096, 65536)
    assert (pass_tokens(0, "cuda"), pass_tokens(8192, "cpu")) == (0, 8192)
    rows = [1500] * 8  # 8 x 1500 padded tokens: four passes on the CPU, one on a GPU
    assert micro_batches(rows, 1, 8, pass_tokens(-1, "cpu")) == [[(0, 2), (2, 4), (4, 6), (6, 8)]]
    assert micro_batches(rows, 1, 8, pass_tokens(-1, "cuda")) == [[(0, 8)]]


def test_every_rank_makes_the_same_number_of_passes():
    # rank 0 needs two passes for its long rows; rank 1 splits its short ones to match (FSDP2 gathers per
    # pass)
    assert micro_batches([2000] * 4 + [100] * 4, 2, 8, 4096) == [[(0, 2), (2, 4)], [(4, 6), (6, 8)]]
    g = torch.Generator().manual_seed(0)
    for ranks in (1, 2, 4):
        for _ in range(50):
            rows = torch.randint(50, 3000, (8,), generator=g).tolist()
            plans = micro_batches(rows, ranks, 3, 4096)
            assert len({len(p) for p in plans}) == 1
            for r, passes in enumerate(plans):  # each rank's groups, in order, once each
                assert [i for a, b in passes for i in range(a, b)] \
                    == list(range(r * 8 // ranks, (r + 1) * 8 // ranks))
                assert all(b - a <= 3 for a, b in passes)


def test_budgeted_passes_give_the_gradients_of_one_pass(tiny_model_dir):
    """The losses normalise by batch totals, so how the batch is cut into passes does not change the step."""
    import algos
    from runtime.schema import RolloutConfig, TrainConfig
    from trainer.learner import Learner

    batch = pack(_groups())
    weights = []
    for micro_tokens in (0, 1):  # one pass; then one group per pass
        train = TrainConfig(batch_groups=2, micro_groups=8, micro_tokens=micro_tokens, lr=1e-2,
                            grad_clip=100.0, autocast="none")
        learner = Learner(model_path=tiny_model_dir, train=train, algo=algos.get("grpo").Config(),
                          rollout=RolloutConfig(group_size=3, max_new_tokens=6, temperature=1.0))
        learner.step(batch, 1)
        weights.append({n: p.detach().clone() for n, p in learner.policy.named_parameters()})
    rows = (batch.segments != PAD).sum(1).tolist()
    assert micro_batches(rows, 1, 8, 0) == [[(0, 2)]] and micro_batches(rows, 1, 8, 1) == [[(0, 1), (1, 2)]]
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    assert any(not torch.equal(initial[n], weights[0]["lm." + n]) for n in initial)  # the step did something
    for name, p in weights[0].items():
        assert torch.allclose(p, weights[1][name], atol=1e-6), name


@pytest.mark.parametrize("max_bad_steps", [1, 2])
def test_non_finite_steps_are_skipped_until_max_bad_steps_in_a_row(tiny_model_dir, max_bad_steps):
    import algos
    from runtime.schema import RolloutConfig, TrainConfig
    from trainer.learner import Learner

    learner = Learner(model_path=tiny_model_dir, algo=algos.get("grpo").Config(),
                      train=TrainConfig(autocast="none", max_bad_steps=max_bad_steps),
                      rollout=RolloutConfig(group_size=3, max_new_tokens=6))
    before = {n: p.detach().clone() for n, p in learner.policy.named_parameters()}
    poisoned = pack(_groups())
    poisoned.rewards[0] = float("nan")
    for step in range(1, max_bad_steps):
        metrics = learner.step(poisoned, step)
        assert metrics["train/skipped_steps"] == step and not math.isfinite(metrics["loss"])
    with pytest.raises(RuntimeError, match=f"{max_bad_steps} steps in a row had a non-finite loss"):
        learner.step(poisoned, max_bad_steps)
    assert all(torch.equal(p, before[n]) for n, p in learner.policy.named_parameters())  # nothing was applied


def test_adam_beta2_reaches_the_optimizer_and_is_range_checked(tiny_model_dir):
    """train.adam_beta2: its schema field and the AdamW line that reads it (the one-knob example of issue
    29)."""
    import algos
    from launch.config import compose, parse
    from runtime.schema import RolloutConfig, TrainConfig
    from trainer.learner import Learner

    learner = Learner(model_path=tiny_model_dir, algo=algos.get("grpo").Config(),
                      train=TrainConfig(autocast="none", adam_beta2=0.99),
                      rollout=RolloutConfig(group_size=3, max_new_tokens=6))
    assert learner.optimizer.param_groups[0]["betas"] == (0.9, 0.99)
    assert parse(compose(["train.adam_beta2=0.95"])).train.adam_beta2 == 0.95
    with pytest.raises(ValueError, match=r"config key 'train.adam_beta2' must be in \(0, 1\) \(got 1.0\)"):
        parse(compose(["train.adam_beta2=1.0"]))


def test_train_share_prefix_reaches_the_policy_and_the_reference(tiny_model_dir):
    import algos
    from runtime.schema import RolloutConfig, TrainConfig
    from trainer.learner import Learner

    for share in (True, False):
        learner = Learner(model_path=tiny_model_dir, algo=algos.get("tb").Config(),
                          train=TrainConfig(batch_groups=2, autocast="none", share_prefix=share),
                          rollout=RolloutConfig(group_size=3, max_new_tokens=6))
        assert learner.reference is not None
        assert learner.policy.share_prefix is share and learner.reference.share_prefix is share


def test_activation_checkpointing_on_the_cpu_gives_the_same_step(tiny_model_dir):
    """cluster.activation_checkpointing on the CPU plan: each decoder layer recomputed in the backward pass,
    the same update, and the weights published under their Hugging Face names."""
    import algos
    from runtime.schema import RolloutConfig, TrainConfig
    from trainer.learner import Learner, Rank
    from trainer.policy import CPUPlacement, full_state

    batch = pack(_groups())
    results = []
    for checkpointing in (False, True):
        learner = Learner(model_path=tiny_model_dir, algo=algos.get("grpo").Config(),
                          train=TrainConfig(batch_groups=2, lr=1e-2, autocast="none"),
                          rollout=RolloutConfig(group_size=3, max_new_tokens=6),
                          rank=Rank(placement=CPUPlacement(checkpointing)))
        wrapped = [type(m).__name__ for m in learner.policy.modules()].count("CheckpointWrapper")
        assert wrapped == (learner.policy.lm.config.num_hidden_layers if checkpointing else 0)
        metrics = learner.step(batch, 1)
        results.append((metrics["loss"], dict(full_state(learner.policy))))
    (loss, plain), (loss_ckpt, ckpt) = results
    assert loss == loss_ckpt and plain.keys() == ckpt.keys()
    for name, value in plain.items():
        assert torch.allclose(value, ckpt[name], atol=1e-6), name


def test_learner_mfu_is_model_flops_over_the_peak_at_the_step_s_threads():
    from trainer.peak import Peak, cpu_peak, learner_mfu

    peak = Peak(((1, 1000.0), (4, 2500.0)))
    assert peak.at(1) == 1000.0 and peak.at(4) == 2500.0
    assert peak.at(2.5) == pytest.approx(1750.0)  # between two measured counts: linear
    assert peak.at(0.5) == 500.0 and peak.at(8) == 5000.0  # outside them: proportional to the threads
    # 600 FLOPs (6 x 100 params) x 50 tokens in 2 s = 15,000 FLOP/s, against 1,750 FLOP/s at 2.5 threads x 2
    # ranks
    assert learner_mfu(600, 50, 2.0, peak, 2.5, 2) == pytest.approx(15000 / 3500)
    threads = torch.get_num_threads()
    measured = cpu_peak(torch.float32, 2, budget_s=0.02)
    assert [count for count, _ in measured.rates] == [1, 2] and torch.get_num_threads() == threads
    assert all(1e8 < rate < 1e13 for _, rate in measured.rates)


def test_the_learner_hands_the_heap_s_free_pages_back_before_every_pass_and_after_the_step(tiny_model_dir,
                                                                                          monkeypatch):
    """Before each long pass, and once the step is done: the engines that generate the next batch (and an
    evaluation) use those pages while the trainer waits."""
    import algos
    import trainer.learner
    from runtime.schema import RolloutConfig, TrainConfig

    calls = []
    monkeypatch.setattr(trainer.learner, "release_free_heap", lambda: calls.append("heap"))
    train = TrainConfig(batch_groups=2, micro_tokens=1, autocast="none")  # one group per pass: two passes
    learner = trainer.learner.Learner(model_path=tiny_model_dir, train=train, algo=algos.get("grpo").Config(),
                                      rollout=RolloutConfig(group_size=3, max_new_tokens=6))
    adamw = learner.optimizer.step
    learner.optimizer.step = lambda: (calls.append("adamw"), adamw())
    batch = pack(_groups())
    learner.step(batch, 1)
    assert calls == ["adamw"]  # short passes keep their pages
    monkeypatch.setattr(trainer.learner, "HEAP_RELEASE_TOKENS", 1)
    learner.step(batch, 2)
    assert calls == ["adamw", "heap", "heap", "adamw", "heap"]


def test_the_learner_settles_the_default_pass_budget_for_its_device(tiny_model_dir, monkeypatch):
    import algos
    import trainer.batch
    from runtime.schema import RolloutConfig, TrainConfig
    from trainer.learner import Learner

    learner = Learner(model_path=tiny_model_dir, train=TrainConfig(batch_groups=2, autocast="none"),
                      algo=algos.get("grpo").Config(), rollout=RolloutConfig(group_size=3, max_new_tokens=6))
    batch = pack(_groups())
    assert learner._passes(batch) == [(0, 2)]
    monkeypatch.setattr(trainer.batch, "PASS_TOKENS", {"cpu": 1, "cuda": 65536})  # a CPU budget of one token
    assert learner._passes(batch) == [(0, 1), (1, 2)]


LIBC = """
import ctypes, resource, sys
sys.path.insert(0, {root!r})
import heap
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
"""

RELEASE = """
def rss_mb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) // 1024
# 100 KB chunks (under glibc's mmap threshold, so in the heap); every other one freed, between live ones: what a
# pass leaves, freed activations between live tensors, which free() alone cannot give back
chunks = [libc.malloc(100 << 10) for _ in range(4000)]
for p in chunks:
    libc.memset(p, 1, 100 << 10)
for p in chunks[::2]:
    libc.free(p)
held = rss_mb()
heap.release_free_heap()
print(held, rss_mb())
"""  # noqa: E501


def _run_with_libc(script: str, needs: str) -> str:
    """`script` after LIBC's set-up, in a fresh interpreter (the C heap's state is the process's); its
    stdout."""
    import os
    import subprocess
    import sys

    import heap

    if getattr(heap, needs) is None:
        pytest.skip("not glibc")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-c", LIBC.format(root=root) + script], capture_output=True,
                          text=True, check=True).stdout


def test_release_free_heap_gives_freed_chunks_between_live_ones_back_to_the_os():
    held, after = map(int, _run_with_libc(RELEASE, "_MALLOC_TRIM").split())
    assert held - after > 120, (held, after)  # of the 195 MB freed


KEEP = """
for call in CALLS:
    heap.keep_freed_chunks(*call)
size = SIZE  # over glibc's largest mmap threshold (32 MB): mapped on its own unless kept
p = libc.malloc(size); libc.memset(p, 1, size); libc.free(p)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
p = libc.malloc(size); libc.memset(p, 1, size)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.parametrize("calls,mb,kept", [
    (((True,),), 64, True), ((), 64, False), (((False,),), 64, False), (((True,), (False,)), 64, False),
    # more than KEEP_TOP freed at once is handed back, unless the top kept is larger (an engine's,
    # engines/builtin.py)
    (((True,),), 320, False), (((True, 512 << 20),), 320, True), (((True, 512 << 20), (True,)), 320, False)])
def test_a_kept_large_chunk_s_pages_are_not_faulted_in_again(calls, mb, kept):
    """heap.keep_freed_chunks(True): a 64 MB chunk freed and allocated again reuses its resident pages. Left
    to glibc, or after keep_freed_chunks(False), it is unmapped, and the new one faults in all its pages
    again. A 320 MB chunk is handed back at KEEP_TOP and kept under a larger `top`, until a later call asks
    for KEEP_TOP again."""
    script = KEEP.replace("CALLS", repr(calls)).replace("SIZE", str(mb << 20))
    faults = int(_run_with_libc(script, "_MALLOPT"))
    # 64 MB is 32 faults even in 2 MB transparent huge pages
    assert faults < 16 if kept else faults >= mb // 2, faults


def _head_case(bias: bool):
    """An output head of 300 tokens over 16 dimensions, 50 hidden rows, their targets and per-row loss
    weights."""
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(300, 16, generator=g))
    hidden, targets = torch.randn(50, 16, generator=g), torch.randint(0, 300, (50,), generator=g)
    return head, hidden, targets, torch.rand(50, generator=g)


@pytest.mark.parametrize("dtype,bias", [(torch.float32, False), (torch.float32, True),
                                        (torch.bfloat16, False)])
def test_the_head_s_chunked_backward_gives_the_whole_gradient_s_values(monkeypatch, dtype, bias):
    """Past WHOLE_GRAD_BYTES the backward never holds the logits' [N, V] gradient; the gradients are the
    same."""
    from trainer.head import _HeadLogprob, head_logprobs

    head, hidden, targets, weights = _head_case(bias)
    monkeypatch.setattr(_HeadLogprob, "CPU_CHUNK_BYTES", 300 * 4 * 7)  # chunks of 7 rows
    grads = []
    for whole in (1 << 30, 0):
        monkeypatch.setattr(_HeadLogprob, "WHOLE_GRAD_BYTES", whole)
        h = hidden.clone().requires_grad_()
        head.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out, _ = head_logprobs(h, head, targets, 0.7)
        (out * weights).sum().backward()
        grads.append([h.grad, head.weight.grad] + ([head.bias.grad] if bias else []))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for whole, chunked in zip(*grads):
        assert whole.abs().sum() > 0
        torch.testing.assert_close(chunked, whole, **tol)


def test_the_head_s_chunks_reuse_one_set_of_buffers_a_pass(monkeypatch):
    """The forward and a recomputing backward each make their [chunk, V] buffers once and reuse them for every
    chunk (a fresh 64 MB tensor faults in all its pages again on the CPU): 8 chunks, 2 float32 buffers a
    pass."""
    from torch.profiler import profile

    import trainer.head as head_module

    head, hidden, targets, weights = _head_case(bias=False)
    chunk_bytes = 7 * 300 * 4
    # chunks of 7 rows: 8 chunks
    monkeypatch.setattr(head_module._HeadLogprob, "CPU_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(head_module._HeadLogprob, "KEEP_LOGITS_BYTES", 0)  # the backward recomputes
    monkeypatch.setattr(head_module._HeadLogprob, "WHOLE_GRAD_BYTES", 0)  # chunk by chunk
    h = hidden.clone().requires_grad_()
    with profile(profile_memory=True) as prof:
        out, _ = head_module.head_logprobs(h, head, targets, 0.7, entropy=True)
        (out * weights).sum().backward()
    chunk_sized = [e.name for e in prof.events() if e.cpu_memory_usage == chunk_bytes]
    assert h.grad.abs().sum() > 0
    assert 0 < len(chunk_sized) <= 4, chunk_sized  # made per chunk, they were 101 events here


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_head_s_backward_reuses_the_forward_s_logits_and_gets_the_same_gradients(monkeypatch, dtype):
    """Small enough, the forward's logits serve the backward: no second lm_head matmul, the same bits; a
    second backward (retain_graph) recomputes them, since the first overwrote them; a forward without
    gradients keeps nothing."""
    import trainer.head as head_module

    head, hidden, targets, weights = _head_case(bias=False)
    # chunks of 7 rows: 8 chunks
    monkeypatch.setattr(head_module._HeadLogprob, "CPU_CHUNK_BYTES", 300 * 4 * 7)
    calls = []
    logits = head_module._logits
    monkeypatch.setattr(head_module, "_logits", lambda *a: calls.append(1) or logits(*a))

    def run(keep: int, twice: bool = False):
        monkeypatch.setattr(head_module._HeadLogprob, "KEEP_LOGITS_BYTES", keep)
        h = hidden.clone().requires_grad_()
        head.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out, _ = head_module.head_logprobs(h, head, targets, 0.7)
        calls.clear()
        (out * weights).sum().backward(retain_graph=twice)
        grads, backward_calls = [h.grad.clone(), head.weight.grad.clone()], len(calls)
        if twice:
            h.grad, head.weight.grad = None, None
            (out * weights).sum().backward()
            return grads, backward_calls, [h.grad, head.weight.grad], len(calls) - backward_calls
        return grads, backward_calls

    kept, kept_calls, again, again_calls = run(1 << 30, twice=True)
    recomputed, recomputed_calls = run(0)
    assert (kept_calls, recomputed_calls, again_calls) == (0, 8, 8)
    for a, b, c in zip(kept, recomputed, again):
        assert a.abs().sum() > 0
        assert torch.equal(a, b) and torch.equal(a, c)
    kept_lists, forward = [], head_module._HeadLogprob.forward

    def watched(ctx, *args):
        out = forward(ctx, *args)
        kept_lists.append(ctx.kept)
        return out

    monkeypatch.setattr(head_module._HeadLogprob, "forward", staticmethod(watched))
    monkeypatch.setattr(head_module._HeadLogprob, "KEEP_LOGITS_BYTES", 1 << 30)
    with torch.no_grad():  # the proximal and reference passes
        head_module.head_logprobs(hidden, head, targets, 0.7)
    head_module.head_logprobs(hidden, head, targets, 0.7)
    assert kept_lists[0] is None and kept_lists[1].shape == (50, 300)


@pytest.mark.parametrize("tied", [True, False])
def test_a_frozen_reference_held_in_bf16_gives_the_same_logprobs_under_autocast(tiny_model_dir, tied):
    from trainer.policy import hold_frozen_in

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                 tie_word_embeddings=tied)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    reference = TokenLogprobs(model).eval().requires_grad_(False)
    batch = pack(_groups())
    inputs = (batch.input_ids, batch.position_ids, batch.segments, batch.gather, batch.targets, 0.7)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        before = reference(*inputs)
        hold_frozen_in(reference, torch.bfloat16)
        after = reference(*inputs)
    assert torch.equal(before, after)
    linears = [m for m in reference.modules() if isinstance(m, torch.nn.Linear)]
    assert all(m.weight.dtype == torch.bfloat16 for m in linears if m is not model.lm_head)
    assert model.lm_head.weight.dtype == (torch.float32 if tied else torch.bfloat16)
    assert model.get_input_embeddings().weight.dtype == torch.float32


@pytest.mark.parametrize("whole", [1 << 30, 0])
def test_a_frozen_head_s_backward_makes_only_the_hidden_rows_gradient(monkeypatch, whole):
    """train.freeze_embeddings on a tied model freezes the head: no gradient for its weight, and the hidden
    rows' gradient direction is made in the forward from its softmax, so the backward does no lm_head matmul
    at all (a trained head's does two); the gradient is the trained head's, whole or chunk by chunk, up to
    float32 rounding."""
    from torch.utils.flop_counter import FlopCounterMode

    from trainer.head import _HeadLogprob, head_logprobs

    head, hidden, targets, weights = _head_case(bias=True)
    monkeypatch.setattr(_HeadLogprob, "CPU_CHUNK_BYTES", 300 * 4 * 7)
    monkeypatch.setattr(_HeadLogprob, "WHOLE_GRAD_BYTES", whole)
    grads, forward_flops, backward_flops = [], [], []
    for trained in (True, False):
        head.requires_grad_(trained)
        head.zero_grad()
        h = hidden.clone().requires_grad_()
        with FlopCounterMode(display=False) as counter:
            out, _ = head_logprobs(h, head, targets, 0.7)
        forward_flops.append(counter.get_total_flops())
        with FlopCounterMode(display=False) as counter:
            (out * weights).sum().backward()
        grads.append(h.grad)
        backward_flops.append(counter.get_total_flops())
    assert head.weight.grad is None and head.bias.grad is None
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)
    product = 2 * 50 * 16 * 300  # one [50, 16] x [16, 300] product
    assert (forward_flops, backward_flops) == ([product, 2 * product], [2 * product, 0])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_frozen_head_s_forward_made_gradient_is_as_close_to_float64_as_the_backward_s(monkeypatch,
                                                                                        temperature):
    """In bf16 the frozen head's direction, (softmax - onehot) @ W rounded before the rows' scale, is no
    further from a float64 gradient than the backward's ((onehot - softmax) x scale) @ W, also on rows whose
    target has most of the mass (where softmax - onehot must not be rounded before the subtraction)."""
    from trainer.head import _HeadLogprob, head_logprobs

    g = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(64, 3000, bias=False).requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(0.3 * torch.randn(3000, 64, generator=g))
    targets = torch.randint(0, 3000, (200,), generator=g)
    hidden = 2 * torch.randn(200, 64, generator=g)
    hidden[:50] = 3 * head.weight[targets[:50]]  # confident rows: the target's probability near 1
    weights = torch.rand(200, generator=g)
    w64, h64 = head.weight.to(torch.bfloat16).double(), hidden.to(torch.bfloat16).double().requires_grad_()
    reference = torch.log_softmax(h64 @ w64.T / temperature, -1).gather(-1, targets[:, None]).squeeze(-1)
    (reference * weights.double()).sum().backward()
    errors = []  # relative to float64, over all rows and over the confident ones: (forward-made, backward's)
    for direction in (True, False):
        monkeypatch.setattr(_HeadLogprob, "FROZEN_DIRECTION", direction)
        h = hidden.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = head_logprobs(h, head, targets, temperature)
        (out * weights).sum().backward()
        errors.append([((h.grad[rows].double() - h64.grad[rows]).norm() / h64.grad[rows].norm()).item()
                       for rows in (slice(None), slice(50))])
    # (softmax rounded to bf16 before the onehot's subtraction: 1.5x and 11x the backward's on the confident
    # rows)
    for made, backward in zip(*errors):
        assert 0 < made <= 1.1 * backward < 0.1, errors


@pytest.mark.parametrize("trained", [False, True])
@pytest.mark.parametrize("keep,whole", [(1 << 30, 1 << 30), (0, 0)])
def test_the_head_s_entropy_gradient_is_plain_autograd_s(monkeypatch, trained, keep, whole):
    """entropy_grad (train.entropy_coef): the entropy gets a gradient, for a frozen head made in the forward,
    for a trained one in the backward (kept logits or recomputed, whole or chunk by chunk), and it is plain
    autograd's over the [N, V] logits, the weight's and bias's too; without entropy_grad the entropy has
    none."""
    from trainer.head import _HeadLogprob, head_logprobs

    head, hidden, targets, weights = _head_case(bias=trained)
    head.requires_grad_(trained)
    monkeypatch.setattr(_HeadLogprob, "CPU_CHUNK_BYTES", 300 * 4 * 7)  # chunks of 7 rows
    monkeypatch.setattr(_HeadLogprob, "KEEP_LOGITS_BYTES", keep)
    monkeypatch.setattr(_HeadLogprob, "WHOLE_GRAD_BYTES", whole)
    entropy_weights = torch.randn(50, generator=torch.Generator().manual_seed(2))
    h = hidden.clone().requires_grad_()
    out, ent = head_logprobs(h, head, targets, 0.7, entropy=True, entropy_grad=True)
    ((out * weights).sum() + (ent * entropy_weights).sum()).backward()

    h_ref = hidden.clone().requires_grad_()
    w_ref = head.weight.detach().clone().requires_grad_(trained)
    b_ref = None if head.bias is None else head.bias.detach().clone().requires_grad_(trained)
    log_p = torch.log_softmax(torch.nn.functional.linear(h_ref, w_ref, b_ref) / 0.7, -1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    ((log_p.gather(-1, targets[:, None]).squeeze(-1) * weights).sum()
     + (entropy * entropy_weights).sum()).backward()

    torch.testing.assert_close(ent, entropy.detach())
    assert h_ref.grad.abs().sum() > 0
    torch.testing.assert_close(h.grad, h_ref.grad, atol=1e-5, rtol=1e-4)
    if trained:
        torch.testing.assert_close(head.weight.grad, w_ref.grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(head.bias.grad, b_ref.grad, atol=1e-5, rtol=1e-4)
    _, ent = head_logprobs(hidden.clone().requires_grad_(), head, targets, 0.7, entropy=True)
    assert not ent.requires_grad


def test_a_frozen_head_is_cast_once_while_its_values_last():
    """Under autocast a frozen head (the tied embeddings) is cast to bf16 once, not in every forward and
    backward; again after its values change in place or its storage is replaced; a trained head is left to the
    head's own cast; and the logprobs are those of the cast made every time."""
    from trainer.head import _frozen_cast, head_logprobs

    head, hidden, targets, _ = _head_case(bias=False)
    head.requires_grad_(False)
    cast = _frozen_cast(head.weight, torch.bfloat16)
    assert cast.dtype == torch.bfloat16 and torch.equal(cast, head.weight.to(torch.bfloat16))
    assert _frozen_cast(head.weight, torch.bfloat16) is cast \
        and _frozen_cast(head.weight, torch.float32) is head.weight
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cached, _ = head_logprobs(hidden, head, targets, 0.7)
    with torch.no_grad():
        head.weight.mul_(2)
    again = _frozen_cast(head.weight, torch.bfloat16)
    assert again is not cast and torch.equal(again, head.weight.to(torch.bfloat16))
    head.weight.data = head.weight.data.clone().div_(2)  # a new storage (hold_frozen_in), the old values
    assert _frozen_cast(head.weight, torch.bfloat16) is not again
    head.requires_grad_(True)
    assert _frozen_cast(head.weight, torch.bfloat16) is head.weight
    with torch.autocast("cpu", dtype=torch.bfloat16):
        uncached, _ = head_logprobs(hidden, head, targets, 0.7)
    assert torch.equal(cached, uncached.detach())


def test_freeze_layers_and_embeddings_train_only_the_layers_above(tiny_model_dir):
    """train.freeze_layers / train.freeze_embeddings: those weights keep their values and get no AdamW state,
    the backward records nothing below the first trained layer, and the rest trains."""
    import algos
    from launch.config import compose, parse
    from runtime.schema import RolloutConfig, TrainConfig
    from trainer.learner import Learner

    learner = Learner(model_path=tiny_model_dir, algo=algos.get("grpo").Config(),
                      train=TrainConfig(autocast="none", lr=1e-2, freeze_layers=1, freeze_embeddings=True),
                      rollout=RolloutConfig(group_size=3, max_new_tokens=6))
    lm = learner.policy.lm
    frozen = {"model.embed_tokens.weight"} \
        | {f"model.layers.0.{n}" for n, _ in lm.model.layers[0].named_parameters()}
    before = {n: p.detach().clone() for n, p in lm.named_parameters()}
    recorded = []
    lm.model.layers[0].register_forward_hook(lambda m, i, out: recorded.append(out[0].requires_grad))
    lm.model.layers[1].register_forward_hook(lambda m, i, out: recorded.append(out[0].requires_grad))
    learner.step(pack(_groups()), 1)
    assert recorded == [False, True]
    changed = {n for n, p in lm.named_parameters() if not torch.equal(p, before[n])}
    assert changed == set(before) - frozen and "model.layers.1.mlp.up_proj.weight" in changed
    in_optimizer = {id(p) for group in learner.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for n, p in lm.named_parameters() if n not in frozen}
    with pytest.raises(ValueError,
                       match="train.freeze_layers=3: the model has 2 decoder layers; freeze at most 2"):
        Learner(model_path=tiny_model_dir, algo=algos.get("grpo").Config(),
                train=TrainConfig(autocast="none", freeze_layers=3), rollout=RolloutConfig(group_size=3))
    with pytest.raises(ValueError, match="LoRA already trains only its adapters"):
        parse(compose(["train.freeze_layers=2", "train.lora.rank=8"]))


def test_the_model_flops_of_a_trained_token_count_only_the_backward_that_runs(tiny_model_dir):
    """perf/learner_mfu's numerator: 6 x parameters when everything trains; frozen bottom layers save their
    share of both backward products, a frozen tied embedding its weight's gradient."""
    from trainer.freeze import freeze, train_flops_per_token

    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    params = sum(p.numel() for p in lm.parameters())
    layer = sum(p.numel() for p in lm.model.layers[0].parameters())
    embedding = lm.get_input_embeddings().weight.numel()
    assert train_flops_per_token(lm) == 6 * params
    freeze(lm, 1, embeddings=True)
    assert train_flops_per_token(lm) == 2 * params + 2 * (params - layer) + 2 * (params - layer - embedding)


def test_resuming_with_other_frozen_weights_than_the_checkpoint_s_is_refused(tiny_model_dir):
    """A checkpoint's AdamW state for a weight this run freezes would be dropped without a word (torch's
    set_optimizer_state_dict skips it): resume= from a run that trained its embeddings needs
    freeze_embeddings=false."""
    import algos
    from runtime.schema import RolloutConfig, TrainConfig
    from trainer.learner import Learner

    def learner(frozen: bool) -> Learner:
        return Learner(model_path=tiny_model_dir, algo=algos.get("grpo").Config(),
                       train=TrainConfig(autocast="none", freeze_embeddings=frozen),
                       rollout=RolloutConfig(group_size=3, max_new_tokens=6))

    import torch.distributed as dist

    from launch.plan import free_port
    from trainer.policy import init_gloo

    # the optimizer's state dict is a collective under FSDP2, a group of one here
    init_gloo(0, 1, free_port())
    try:
        trained_all = learner(False).optimizer_state()
        assert "lm.model.embed_tokens.weight" in trained_all["state"]
        learner(False).load_optimizer_state(trained_all)  # the same weights: loads
        with pytest.raises(ValueError,
                           match=r"the checkpoint trained model.embed_tokens.weight \(1 weights\), "
                                 r"which this run freezes; .*train.freeze_embeddings=false"):
            learner(True).load_optimizer_state(trained_all)
        with pytest.raises(ValueError, match="the checkpoint did not train model.embed_tokens.weight"):
            learner(False).load_optimizer_state(learner(True).optimizer_state())
    finally:
        dist.destroy_process_group()
