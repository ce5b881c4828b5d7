"""The weight store never lets a reader see a torn snapshot, and converts into whatever targets the engine
has."""
import time

import pytest
import torch
import torch.multiprocessing as mp

from engines.weights import WeightStore

SHAPES = {
    "embed.weight": (torch.Size([512, 512]), torch.float32),
    "layers.0.mlp.weight": (torch.Size([1024, 256]), torch.float32),
    "layers.0.norm.weight": (torch.Size([512]), torch.float32),
    "head.weight": (torch.Size([256, 384]), torch.bfloat16),  # a second dtype gets its own buffer
}
LAST_VERSION = 200  # every version is exact in bf16 (integers up to 256)


def _write_versions(store: WeightStore):
    # two processes of two OpenMP threads each on 2 cores spin-wait each other to a crawl
    torch.set_num_threads(1)
    for v in range(1, LAST_VERSION + 1):
        store.publish(((name, torch.full(shape, float(v))) for name, (shape, _) in SHAPES.items()), version=v)
        if v % 3 == 0:
            time.sleep(0.001)  # vary the spacing, so reads land both inside and between publishes


def _read_versions(store: WeightStore, report: torch.Tensor):
    """report = [reads, torn reads, version went backwards, distinct versions seen]."""
    torch.set_num_threads(1)
    holder = torch.zeros(512, 1024)
    # Reverse of the writer's order, so a read overlapping a publish would mix versions rather than trail it.
    targets = {
        "head.weight": torch.zeros(256, 384),
        "layers.0.norm.weight": torch.zeros(512),
        "layers.0.mlp.weight": torch.zeros(1024, 256, dtype=torch.bfloat16),
        "embed.weight": holder[:, :512],  # a non-contiguous view, as an engine's fused parameter might be
    }
    last, seen = 0, set()
    while last < LAST_VERSION:
        version = store.read_into(targets)
        report[0] += 1
        if any(t.min() != version or t.max() != version for t in targets.values()):
            report[1] += 1
        if version < last:
            report[2] += 1
        last = version
        seen.add(version)
    report[3] = len(seen)


def test_concurrent_reads_are_never_torn():
    ctx = mp.get_context("spawn")
    store = WeightStore(SHAPES)
    report = torch.zeros(4, dtype=torch.int64).share_memory_()
    reader = ctx.Process(target=_read_versions, args=(store, report), daemon=True)
    reader.start()
    while report[0] == 0 and reader.is_alive():  # start writing once the reader is up, so the two overlap
        time.sleep(0.01)
    writer = ctx.Process(target=_write_versions, args=(store,), daemon=True)
    writer.start()
    writer.join(60)
    reader.join(60)
    assert writer.exitcode == 0 and reader.exitcode == 0
    reads, torn, backwards, distinct = report.tolist()
    assert torn == 0 and backwards == 0
    assert distinct > 5, f"reader saw only {distinct} versions in {reads} reads: the test did not overlap"
    assert store.version == LAST_VERSION


def test_publish_and_read_in_process():
    store = WeightStore(SHAPES)
    assert store.version == 0
    store.publish([("layers.0.norm.weight", torch.arange(512.0))], version=3)
    assert store.version == 3
    target = torch.empty(512, dtype=torch.bfloat16)
    assert store.read_into({"layers.0.norm.weight": target, "not.in.store": torch.empty(1)}) == 3
    assert torch.equal(target, torch.arange(512.0).to(torch.bfloat16))
    with pytest.raises(ValueError, match="unknown weight"):
        store.publish([("nope", torch.zeros(1))], version=4)
    with pytest.raises(ValueError, match="shape"):
        store.publish([("layers.0.norm.weight", torch.zeros(511))], version=4)
    with pytest.raises(ValueError, match="shape"):
        store.read_into({"layers.0.norm.weight": torch.zeros(2, 256)})
    assert store.version == 3
    assert store.read_into({}) == 3  # a failed publish left the counter even: readers are not stuck


def test_for_model_keeps_floating_state_and_tied_weights():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False),
                                torch.nn.BatchNorm1d(10))
    model[1].weight = model[0].weight  # tied, as in SmolLM2
    store = WeightStore.for_model(model)
    assert set(store.names) \
        == {"0.weight", "1.weight", "2.weight", "2.bias", "2.running_mean", "2.running_var"}
    store.publish([(k, v) for k, v in model.state_dict().items() if v.is_floating_point()], version=1)
    copy = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False),
                               torch.nn.BatchNorm1d(10))
    store.read_into(dict(copy.named_parameters()))
    assert torch.equal(copy[1].weight, model[0].weight) and torch.equal(copy[0].weight, model[0].weight)


def test_a_store_in_the_engines_dtype_holds_half_and_reads_what_the_engine_would_load():
    model = torch.nn.Linear(64, 32)
    full, half = WeightStore.for_model(model), WeightStore.for_model(model, torch.bfloat16)
    assert sum(b.numel() * b.element_size() for b in half._buffers.values()) * 2 == \
        sum(b.numel() * b.element_size() for b in full._buffers.values())
    for store in (full, half):
        store.publish(model.state_dict().items(), version=1)
    from_full = {n: torch.empty_like(t, dtype=torch.bfloat16) for n, t in model.state_dict().items()}
    from_half = {n: torch.empty_like(t, dtype=torch.bfloat16) for n, t in model.state_dict().items()}
    full.read_into(from_full)
    half.read_into(from_half)
    for name in from_full:  # rounded once either way: at publication or at the engine's load
        assert torch.equal(from_half[name], from_full[name])
        assert torch.equal(from_half[name], model.state_dict()[name].to(torch.bfloat16))


def test_a_write_cut_off_part_way_holds_readers_until_a_complete_one():
    """A generator node's receive cut off part way (cluster=ray: its agent stopped, the link gone) leaves
    parts of two versions in the buffers: readers wait for the next complete write, which they then read
    (before, the failed write flipped the counter's parity and every later read waited for ever)."""
    import threading

    store = WeightStore({"w": ((4,), torch.float32)})
    with pytest.raises(RuntimeError, match="cut off"):
        with store.writing(1):
            store.buffers()[0][:2] = 1.0
            raise RuntimeError("cut off")
    assert store.version == 0
    read = []
    reader = threading.Thread(target=lambda: read.append(store.read_into({"w": torch.zeros(4)})), daemon=True)
    reader.start()
    reader.join(timeout=0.5)
    assert reader.is_alive() and not read  # it waits: what the store holds is no version
    with store.writing(2):
        store.buffers()[0].fill_(2.0)
    reader.join(timeout=60)
    assert read == [2]
    target = {"w": torch.zeros(4)}
    assert store.read_into(target) == 2 and target["w"].tolist() == [2.0] * 4
