"""MetricsLogger's promises: every row in metrics.jsonl, the backends get the numbers, the console stays
readable."""
import glob
import io
import json
import os
import struct

import pytest

from tests.helpers import alive, descendants
from trainer import logger as logger_mod
from trainer.logger import MetricsLogger, check_backend, truncate_metrics, wandb_mode


def _row(step: int) -> dict:
    row = {"step": step, "time_s": 2.0 * step, "reward_mean": 0.25 * step, "loss": 1.0 / step,
           "staleness_mean": 0.5, "staleness_max": 1, "gen_tokens_per_s": 300.0, "train_tokens_per_s": 120.0,
           "grpo/clip_frac": 0.1, "note": "not a number"}
    if step % 2 == 0:
        row["eval_pass@1"] = 0.5
    return row


def _read(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_rows_are_appended_and_a_resumed_run_keeps_them(tmp_path):
    with MetricsLogger(str(tmp_path), "none", steps=4, progress=False) as log:
        for step in (1, 2, 3):
            log.log(_row(step))
            assert _read(tmp_path / "metrics.jsonl")[-1] == _row(step)  # flushed at once, not at close
    # resume from the checkpoint of step 2: step 3 goes, a crash's half line goes, steps 1-2 stay
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "rew')
    assert truncate_metrics(str(tmp_path / "metrics.jsonl"), 2) == 2
    assert os.listdir(tmp_path) == ["metrics.jsonl"]  # no temporary file left
    with MetricsLogger(str(tmp_path), "none", steps=4, progress=False, start_step=2) as log:
        log.log(_row(3))
        log.log(_row(4))
    assert [r["step"] for r in _read(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert truncate_metrics(str(tmp_path / "absent.jsonl"), 1) == 0


def test_unknown_backend_and_missing_package_fail_in_one_line(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="must be one of none, tensorboard, wandb"):
        MetricsLogger(str(tmp_path), "mlflow")
    monkeypatch.setattr(logger_mod, "find_spec", lambda name: None)
    fix = r"^logger=tensorboard needs the tensorboard package: pip install tensorboard$"
    with pytest.raises(ValueError, match=fix):
        check_backend("tensorboard")
    with pytest.raises(ValueError, match="pip install wandb"):
        MetricsLogger(str(tmp_path), "wandb")
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before touching the run dir


def test_tensorboard_events_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(str(tmp_path), "tensorboard", steps=3, progress=False,
                       config={"max_staleness": 2}) as log:
        for step in (1, 2, 3):
            log.log(_row(step))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"reward_mean", "loss", "staleness_max", "grpo/clip_frac", "eval_pass@1"} <= scalars
    assert "note" not in scalars and "step" not in scalars
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [e.step for e in events.Scalars("eval_pass@1")] == [2]


def test_wandb_offline_run_is_written_under_the_run_dir_and_its_service_stops(monkeypatch, tmp_path):
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_INIT_TIMEOUT": "60",
                       "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
                       "WANDB_CACHE_DIR": str(tmp_path / "cache"),
                       "WANDB_DATA_DIR": str(tmp_path / "data")}.items():
        monkeypatch.setenv(key, value)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with MetricsLogger(str(run_dir), "wandb", steps=3, progress=False, config={"max_staleness": 2}) as log:
        for step in (1, 2, 3):
            log.log(_row(step))
    from tests.conftest import _is_mp_helper

    left = [p for p in descendants(os.getpid()) if alive(p) and not _is_mp_helper(p)]
    assert not left, "wandb's service process outlived close()"
    files = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, os.listdir(run_dir)
    history = _wandb_history(files[0])
    assert [h["_step"] for h in history] == [1, 2, 3]
    assert [h["reward_mean"] for h in history] == [0.25, 0.5, 0.75]
    assert history[1]["eval_pass@1"] == 0.5 and "note" not in history[0]


def _wandb_history(path) -> list[dict]:
    """The logged rows of a W&B transaction log: LevelDB-log framed `Record` protobufs after a 7-byte
    header."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    pos, block, chunk, history = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                for i in record.history.item})
    return history


def test_wandb_mode_offline_without_a_key(monkeypatch, tmp_path):
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_mode() == "offline"  # no netrc file
    (tmp_path / "netrc").write_text("machine example.com login user password secret\n")
    assert wandb_mode() == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password 0123456789abcdef\n")
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("NETRC", str(tmp_path / "absent"))
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    assert wandb_mode() == "online"


def test_console_without_a_terminal_prints_plain_lines(capfd, tmp_path):
    with MetricsLogger(str(tmp_path), "none", steps=3, progress=True, line_every_s=0) as log:
        for step in (1, 2, 3):
            log.log(_row(step))
    err = capfd.readouterr().err
    assert "\r" not in err and "\x1b" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 3
    assert lines[1].startswith("step 2/3") and "reward 0.500" in lines[1] and "stale 0.50" in lines[1]
    assert "gen_tok/s 300" in lines[1] and "train_tok/s 120" in lines[1] and "pass@1 0.500" in lines[1]


def test_the_console_says_when_the_trainer_waits_for_data(capfd, tmp_path):
    with MetricsLogger(str(tmp_path), "none", steps=3, progress=True, line_every_s=0) as log:
        log.log(_row(1))
        log.waiting(3.0, 0, 4)  # a short wait is a normal step's
        log.waiting(42.4, 1, 4)
    lines = capfd.readouterr().err.strip().splitlines()
    assert lines[1:] == ["waiting for data 42 s (1/4 groups)"]


def test_console_without_a_terminal_throttles_to_first_and_last(capfd, tmp_path):
    with MetricsLogger(str(tmp_path), "none", steps=5, progress=True, line_every_s=3600) as log:
        for step in range(1, 6):
            log.log(_row(step))
    lines = capfd.readouterr().err.strip().splitlines()
    assert [line.split()[1] for line in lines] == ["1/5", "5/5"]


def test_console_on_a_terminal_is_one_bar(monkeypatch, tmp_path):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    with MetricsLogger(str(tmp_path), "none", steps=3, progress=True) as log:
        for step in (1, 2, 3):
            log.log(_row(step))
    out = screen.getvalue()
    assert "3/3" in out and "reward=0.750" in out and "\r" in out
    assert "step 1/3" not in out  # no plain lines on a terminal

