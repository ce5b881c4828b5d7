"""trainer/attention.py: attention over packed group rows, one call per prompt and per completion, against the
dense [L, L] shared-prompt mask it replaces for long rows."""
import pytest
import torch

import trainer.attention as attention
from buffer.ring import Group
from tests.tiny_models import tiny_model
from trainer.attention import Spans
from trainer.batch import PAD, SharedPrefix, hoist_prefix, pack
from trainer.policy import TokenLogprobs


def _groups(lens: list[list[int]], prompts: list[int], seed: int = 0, vocab: int = 512) -> list[Group]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for index, (n, p) in enumerate(zip(lens, prompts)):
        k, longest = len(n), max(n)
        out.append(Group(torch.randint(3, vocab, (p,), generator=g),
                         torch.randint(3, vocab, (k, longest), generator=g), torch.tensor(n),
                         torch.zeros(k, longest), torch.zeros(k, longest, dtype=torch.long),
                         torch.rand(k, generator=g), torch.zeros(k, dtype=torch.bool), index, index, 0))
    return out


def test_spans_say_where_each_prompt_and_completion_lies():
    batch = pack(_groups([[3, 1, 4], [2, 2, 5]], prompts=[6, 2]))
    spans = Spans.of(batch.segments)
    # row 0: prompt 6, completions of 3, 1, 4 tokens back to back; row 1: prompt 2, then 2, 2, 5; padded to 14
    assert spans.rows == [(6, [(6, 9), (9, 10), (10, 14)], 14), (2, [(2, 4), (4, 6), (6, 11)], 11)]
    assert batch.segments.shape[1] == 14
    mask = spans.mask(2, 3)  # a 3-token completion after a 2-token prompt
    assert mask.tolist() == [[True, True, True, False, False], [True, True, True, True, False], [True] * 5]


def _logprobs_and_grads(policy, batch):
    policy.zero_grad()
    out = policy(batch.input_ids, batch.position_ids, batch.segments, batch.gather, batch.targets, 0.8)
    (out * batch.mask).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in policy.named_parameters()}


@pytest.mark.parametrize("kind", ["llama3", "qwen3", "gemma", "gpt2"])
def test_per_segment_attention_and_masked_matmuls_give_sdpa_s_logprobs_and_gradients(kind, monkeypatch):
    policy = TokenLogprobs(tiny_model(kind))
    assert policy.segment_attention
    batch = pack(_groups([[40, 1, 17, 33], [5, 60, 2, 9], [21, 21, 21, 21]], prompts=[23, 7, 1], seed=1))
    monkeypatch.setattr(attention, "MIN_ROW", 10**9)  # every row below it: the dense mask, through SDPA
    monkeypatch.setattr(attention, "MATMUL_ROW", 0)
    dense, dense_grads = _logprobs_and_grads(policy, batch)
    used = []
    monkeypatch.setattr(attention, "_masked_matmuls",
                        lambda *a, f=attention._masked_matmuls: used.append(1) or f(*a))
    monkeypatch.setattr(attention, "MATMUL_ROW", 10**9)  # every row below it: the dense mask, as two matmuls
    monkeypatch.setattr(attention, "MATMUL_DTYPES", (torch.float32,))  # the tiny models' float32 too
    matmuls, matmul_grads = _logprobs_and_grads(policy, batch)
    assert len(used) == 2, "the masked matmuls were not taken in both layers"
    monkeypatch.setattr(attention, "MIN_ROW", 1)
    monkeypatch.setattr(Spans, "of", staticmethod(lambda seg, of=Spans.of: used.append(1) or of(seg)))
    spans, span_grads = _logprobs_and_grads(policy, batch)
    assert len(used) == 3, "the per-segment path was not taken"
    real = batch.mask.bool()
    assert int(real.sum()) == 40 + 1 + 17 + 33 + 5 + 60 + 2 + 9 + 21 * 4
    for out, grads in ((spans, span_grads), (matmuls, matmul_grads)):
        torch.testing.assert_close(out[real], dense[real], atol=2e-5, rtol=1e-5)
        for name, grad in dense_grads.items():
            assert (grads[name] - grad).norm() <= 1e-4 * grad.norm() + 1e-6, name


def test_the_layout_by_row_length_and_device():
    long, short = torch.zeros(2, attention.MIN_ROW, dtype=torch.long), torch.zeros(2, 100, dtype=torch.long)
    middle = torch.zeros(2, attention.MATMUL_ROW, dtype=torch.long)
    assert attention.MATMUL_ROW <= attention.MIN_ROW
    assert isinstance(attention.layout(long)["segment_spans"], Spans)
    assert attention.layout(short) == {}  # float32: SDPA
    assert attention.layout(short.to("meta")) == {}  # not a CPU: SDPA's kernels there
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attention.layout(short) == {"masked_matmuls": True}
        assert attention.layout(middle) == {}  # SDPA over the dense mask
        assert attention.layout(short.to("meta")) == {}


def test_a_bf16_step_s_short_rows_take_the_masked_matmuls_and_a_float32_one_sdpa(monkeypatch):
    used = []
    monkeypatch.setattr(attention, "_masked_matmuls",
                        lambda *a, f=attention._masked_matmuls: used.append(1) or f(*a))
    policy = TokenLogprobs(tiny_model("llama3"))
    short = pack(_groups([[3, 4], [5, 1]], prompts=[4, 4]))
    args = short.input_ids, short.position_ids, short.segments, short.gather, short.targets, 1.0
    policy(*args)
    assert not used
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = policy(*args)
    assert len(used) == 2 and torch.isfinite(out).all()  # both layers


def test_masked_matmuls_take_an_additive_mask_and_grouped_heads_as_sdpa_does():
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, h, 7, 8, generator=g) for h in (6, 2, 2))
    allowed = torch.rand(2, 1, 7, 7, generator=g) > 0.4
    allowed |= torch.eye(7, dtype=torch.bool)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, -1e9)
    want = torch.nn.functional.scaled_dot_product_attention(query, key.repeat_interleave(3, 1),
                                                            value.repeat_interleave(3, 1), attn_mask=allowed,
                                                            scale=0.3)
    for mask in (allowed, additive):
        torch.testing.assert_close(attention._masked_matmuls(query, key, value, mask, 0.3), want)
    per_head = torch.rand(2, 6, 7, 7, generator=g) > 0.4  # a mask of its own for each query head
    per_head |= torch.eye(7, dtype=torch.bool)
    want = torch.nn.functional.scaled_dot_product_attention(query, key.repeat_interleave(3, 1),
                                                            value.repeat_interleave(3, 1), attn_mask=per_head)
    torch.testing.assert_close(attention._masked_matmuls(query, key, value, per_head, None), want)


def test_short_rows_keep_the_dense_mask_and_eager_models_keep_their_attention(monkeypatch):
    used = []
    monkeypatch.setattr(Spans, "of", staticmethod(lambda seg, of=Spans.of: used.append(1) or of(seg)))
    policy = TokenLogprobs(tiny_model("llama3"))
    short = pack(_groups([[3, 4], [5, 1]], prompts=[4, 4]))
    assert short.segments.shape[1] < attention.MIN_ROW
    policy(short.input_ids, short.position_ids, short.segments, short.gather, short.targets, 1.0)
    assert not used
    eager = tiny_model("llama3", attn_implementation="eager")
    assert not TokenLogprobs(eager).segment_attention and eager.config._attn_implementation == "eager"
    monkeypatch.setattr(attention, "MIN_ROW", 1)
    a = TokenLogprobs(eager)(short.input_ids, short.position_ids, short.segments, short.gather,
                             short.targets, 1.0)
    assert not used and torch.isfinite(a).all()  # no layout handed to a model that would not use it


def test_the_checkpoint_s_config_keeps_the_model_s_own_attention(tmp_path):
    import json

    lm = tiny_model("llama3")
    TokenLogprobs(lm)
    lm.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert attention.NAME not in json.dumps(saved)


def test_a_switched_model_still_masks_as_sdpa_for_callers_without_a_4d_mask():
    """Two sequences back to back in one row, told apart by positions that restart: the mask HF builds from
    them must keep the second from seeing the first, as under SDPA."""
    sdpa, switched = tiny_model("llama3"), tiny_model("llama3")
    assert TokenLogprobs(switched).segment_attention
    ids = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with torch.no_grad():
        want = sdpa.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        got = switched.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        alone = sdpa.model(input_ids=ids[:, 5:], use_cache=False).last_hidden_state
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got[:, 5:], alone, atol=1e-5, rtol=1e-5)


def test_per_segment_attention_under_activation_checkpointing_gives_the_dense_gradients(monkeypatch):
    """GSM8K's preset: each decoder layer recomputed in the backward, with the layout handed down as a
    keyword."""
    from trainer.policy import checkpoint_layers

    policy = TokenLogprobs(tiny_model("qwen3"))
    checkpoint_layers(policy)
    batch = pack(_groups([[30, 12, 25], [9, 31, 4]], prompts=[11, 5], seed=2))
    monkeypatch.setattr(attention, "MIN_ROW", 10**9)
    dense, dense_grads = _logprobs_and_grads(policy, batch)
    used = []
    monkeypatch.setattr(attention, "MIN_ROW", 1)
    monkeypatch.setattr(attention, "sdpa",
                        lambda *a, sdpa=attention.sdpa, **k: used.append(1) or sdpa(*a, **k))
    spans, span_grads = _logprobs_and_grads(policy, batch)
    # inside the layers, in the forward and again in the backward's recompute: (1 prompt + 3 completions) x 2
    # rows x 2 layers x 2
    assert len(used) == 4 * 2 * 2 * 2
    torch.testing.assert_close(spans[batch.mask.bool()], dense[batch.mask.bool()], atol=2e-5, rtol=1e-5)
    for name, grad in dense_grads.items():
        assert (span_grads[name] - grad).norm() <= 1e-4 * grad.norm() + 1e-6, name


def _sharing(groups: list[Group], prefix: int, seed: int = 3) -> list[Group]:
    """The groups with the first `prefix` tokens of their prompts made the same (a system prompt)."""
    common = torch.randint(3, 512, (prefix,), generator=torch.Generator().manual_seed(seed))
    for group in groups:
        group.prompt_ids[:prefix] = common
    return groups


def test_the_prompts_common_prefix_is_kept_once_in_the_shortest_row():
    batch = pack(_sharing(_groups([[4, 1, 6], [2, 2, 3], [5, 5, 5]], prompts=[9, 7, 8]), 5))
    used = (batch.segments != PAD).sum(1)
    assert used.tolist() == [20, 14, 23] and batch.segments.shape[1] == 23
    ids, positions, segments, gather, shared = hoist_prefix(batch.input_ids, batch.position_ids,
                                                            batch.segments, batch.gather)
    assert shared == SharedPrefix(length=5, row=1)  # the shortest row keeps it
    assert segments.shape == ids.shape == positions.shape == (3, 18)  # the longest row less the prefix
    for row, shift in enumerate((5, 0, 5)):
        n = int(used[row]) - shift
        assert ids[row, :n].tolist() == batch.input_ids[row, shift:shift + n].tolist()
        assert positions[row, :n].tolist() == batch.position_ids[row, shift:shift + n].tolist()  # unchanged
        assert segments[row, :n].tolist() == batch.segments[row, shift:shift + n].tolist()
        assert (segments[row, n:] == PAD).all() and (ids[row, n:] == 0).all()
    # every position the head reads is the token it read before, at its place
    real = batch.mask.view(3, -1).bool()
    for new, old in ((ids, batch.input_ids), (positions, batch.position_ids)):
        assert torch.equal(new.gather(1, gather)[real], old.gather(1, batch.gather)[real])


def test_rows_are_left_as_they_are_where_hoisting_would_not_shorten_them():
    def hoisted(groups):
        batch = pack(groups)
        return hoist_prefix(batch.input_ids, batch.position_ids, batch.segments, batch.gather)

    assert hoisted(_sharing(_groups([[4, 1], [2, 2]], prompts=[9, 7]), 0)) is None  # no common prefix
    assert hoisted(_sharing(_groups([[4, 1]], prompts=[9]), 5)) is None  # one row
    assert hoisted(_sharing(_groups([[4, 1], [1, 4]], prompts=[9, 9]), 5)) is None  # rows of one length
    same = _groups([[4, 1], [2, 2]], prompts=[6, 6])
    same[1].prompt_ids = same[0].prompt_ids.clone()
    # the whole prompt in common: each row keeps its last prompt token, whose output predicts its first
    # completion token
    assert hoisted(same)[4] == SharedPrefix(length=5, row=1)


def _embedded_shapes(policy) -> list:
    shapes = []
    policy.lm.get_input_embeddings().register_forward_pre_hook(
        lambda module, args: shapes.append(args[0].shape))
    return shapes


WAYS = {"sdpa": dict(MIN_ROW=10**9, MATMUL_ROW=0),
        "matmuls": dict(MIN_ROW=10**9, MATMUL_ROW=10**9, MATMUL_DTYPES=(torch.float32,)),
        "segments": dict(MIN_ROW=1)}


@pytest.mark.parametrize("kind", ["llama3", "qwen3", "gemma", "gpt2"])
@pytest.mark.parametrize("way", list(WAYS))
def test_a_shared_prefix_gives_the_logprobs_and_gradients_of_rows_that_each_hold_it(kind, way, monkeypatch):
    for name, value in WAYS[way].items():
        monkeypatch.setattr(attention, name, value)
    policy = TokenLogprobs(tiny_model(kind))
    shapes = _embedded_shapes(policy)
    batch = pack(_sharing(_groups([[40, 1, 17, 33], [5, 60, 2, 9], [21, 21, 21, 21]],
                                  prompts=[23, 7, 9], seed=1), 6))
    policy.share_prefix = False
    whole, whole_grads = _logprobs_and_grads(policy, batch)
    policy.share_prefix = True
    shared, shared_grads = _logprobs_and_grads(policy, batch)
    assert shapes == [(3, 114), (3, 108)]  # the prefix dropped from the rows that do not keep it
    real = batch.mask.bool()
    torch.testing.assert_close(shared[real], whole[real], atol=2e-5, rtol=1e-5)
    for name, grad in whole_grads.items():
        assert (shared_grads[name] - grad).norm() <= 1e-4 * grad.norm() + 1e-6, name


def test_a_shared_prefix_under_activation_checkpointing_gives_the_same_gradients(monkeypatch):
    from trainer.policy import checkpoint_layers

    monkeypatch.setattr(attention, "MIN_ROW", 1)
    policy = TokenLogprobs(tiny_model("qwen3"))
    checkpoint_layers(policy)
    batch = pack(_sharing(_groups([[30, 12, 25], [9, 31, 4]], prompts=[11, 5], seed=2), 4))
    policy.share_prefix = False
    whole, whole_grads = _logprobs_and_grads(policy, batch)
    policy.share_prefix = True
    shared, shared_grads = _logprobs_and_grads(policy, batch)
    torch.testing.assert_close(shared[batch.mask.bool()], whole[batch.mask.bool()], atol=2e-5, rtol=1e-5)
    for name, grad in whole_grads.items():
        assert (shared_grads[name] - grad).norm() <= 1e-4 * grad.norm() + 1e-6, name
