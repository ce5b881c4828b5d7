"""Checkpoints: `checkpoints/step_N/` is a Hugging Face model folder (safetensors, loadable anywhere) plus
`trainer_state.pt`, everything else a resumed run needs: AdamW, the replay buffer, RNG states, data
positions, the policy version. The state holds tensors and plain Python values only and is read back with
`torch.load(weights_only=True)`, so resuming never unpickles code.

A checkpoint is written into a hidden temporary folder and renamed into place, so a crash mid-write leaves
the previous checkpoint intact and no half-written one under a `step_N` name.
"""
import errno
import json
import os
import re
import shutil

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from engines.buckets import engine_name
from trainer.lora import is_lora, merged, save_adapter

STATE_FILE = "trainer_state.pt"
PROGRESS_FILE = "progress.json"


def save_checkpoint(policy, model_path: str, run_dir: str, step: int, state: dict | None = None,
                    keep: int = 0) -> str:
    """Gather the full weights (all ranks call this) and write them, with `state`, atomically from rank 0.
    keep > 0: afterwards delete all but the newest `keep` checkpoints."""
    raw = gathered_weights(policy)
    weights = dict(merged(raw.items(), policy.lm))  # a LoRA model's merged; the same dict's items otherwise
    root = os.path.join(run_dir, "checkpoints")
    target = os.path.join(root, f"step_{step}")
    if dist.get_rank() != 0:
        return target
    from transformers import AutoTokenizer

    tmp = os.path.join(root, f".tmp-step_{step}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        policy.lm.save_pretrained(tmp, state_dict=weights)
        if is_lora(policy.lm):
            save_adapter(tmp, raw, policy.lm)  # beside the merged model: what a resumed run reloads
        AutoTokenizer.from_pretrained(model_path).save_pretrained(tmp)
        if state is not None:
            torch.save(state, os.path.join(tmp, STATE_FILE))
            # what the launcher needs, without the 1 GB
            with open(os.path.join(tmp, PROGRESS_FILE), "w") as f:
                json.dump({k: state[k] for k in ("step", "time_s", "next_group")}, f)
        _fsync_dir(tmp)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)  # the half-written one; the previous checkpoint is untouched
        if isinstance(e, OSError) and e.errno == errno.ENOSPC or "No space left on device" in str(e):
            gb = sum(t.numel() * t.element_size() for t in weights.values()) / 1e9
            full = OSError(f"no space left on the device for checkpoint step_{step} in {root} (the weights "
                           f"alone are {gb:.1f} GB; the previous checkpoint is intact): free space, or set "
                           "checkpoint.keep=1 or checkpoint.at_end=false")
            full.errno = errno.ENOSPC
            raise full from None
        raise
    if os.path.exists(target):  # rewriting a step: move the old one aside first, so a crash keeps one of them
        old = os.path.join(root, f".old-step_{step}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)
    _fsync_dir(root)
    if keep > 0:
        for _, path in checkpoints(run_dir)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
    return target


def gathered_weights(policy) -> dict[str, torch.Tensor]:
    """The full weights under their Hugging Face names, gathered into rank 0's CPU memory one tensor at a time
    (a collective; the other ranks get {}): no full copy of the model on a GPU, nor on every rank."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(policy, options=options)
    return {engine_name(name): tensor.detach().clone() for name, tensor in state.items()}


def checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints of a run, oldest first, as (step, path)."""
    root = os.path.join(run_dir, "checkpoints")
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        match = re.fullmatch(r"step_(\d+)", name)
        if match and os.path.exists(os.path.join(root, name, "config.json")):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def latest_resumable(run_dir: str) -> tuple[int, str]:
    """The newest checkpoint that holds a trainer state; ValueError naming the problem if there is none."""
    for step, path in reversed(checkpoints(run_dir)):
        if os.path.exists(os.path.join(path, STATE_FILE)):
            return step, path
    raise ValueError(f"resume: no checkpoint with {STATE_FILE} under {os.path.join(run_dir, 'checkpoints')}; "
                     "set checkpoint.every to write them")


def load_state(path: str) -> dict:
    return torch.load(os.path.join(path, STATE_FILE), weights_only=True)


def load_progress(path: str) -> dict:
    """step, time_s and next_group ({worker id: groups it had delivered}) of a checkpoint."""
    with open(os.path.join(path, PROGRESS_FILE)) as f:
        progress = json.load(f)
    progress["next_group"] = {int(w): n for w, n in progress["next_group"].items()}
    return progress


def _fsync_dir(path: str) -> None:
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            with open(full, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
