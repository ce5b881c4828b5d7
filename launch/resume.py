"""`resume=<run dir>`: the run's own config, and the checkpoint it continues from."""
import os

from omegaconf import OmegaConf

from launch.config import GROUPS


def resumed_config(raw, overrides: list[str]):
    """That run's saved config, with this command's plain `key=value` overrides on top (not `algo=` & co.)."""
    path = os.path.join(raw.resume, "config.yaml")
    if not os.path.exists(path):
        raise ValueError(f"resume={raw.resume} has no config.yaml; pass the directory of a ringrl run")
    overrides = [o for o in overrides if not o.startswith(("resume=", "hydra."))]
    for o in overrides:
        group = o.partition("=")[0]
        if group in GROUPS:
            raise ValueError(f"resume cannot change '{o}'; start a new run for another {group}")
    merged = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(overrides))
    merged.resume = raw.resume
    return merged


def resume_point(run_dir: str) -> dict:
    """step, path, time_s and next_group ({worker: groups delivered}) of the latest resumable checkpoint."""
    from trainer.checkpoint import latest_resumable, load_progress

    step, path = latest_resumable(run_dir)
    return {**load_progress(path), "step": step, "path": path}
