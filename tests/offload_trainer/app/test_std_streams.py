"""offload-train with standard streams that differ from a terminal's: a stdout whose reader went away
(`offload-train | head`), descriptors 0-2 closed at start (`offload-train >&-`). The run goes on
and ends as usual; nothing meant for stdout or stderr lands in a file the run opened."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable, List

import pytest

from offload_trainer.app import cli


def test_a_stdout_whose_reader_went_away_stops_the_lines_not_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture, tiny_run_args: Callable[..., List[str]]
) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE, as after `| head -1` exits
    broken = open(write_end, "w")
    monkeypatch.setattr(sys, "stdout", broken)
    try:
        status = cli.main(tiny_run_args())
    finally:
        broken.close()
    err = capfd.readouterr().err.strip().splitlines()
    assert status == 0
    assert len(err) == 1 and "warning: stdout could not be written" in err[0] and "metrics.jsonl" in err[0]
    out = tmp_path / "out"
    assert (out / "latest").read_text().strip() == "ckpt-000002"
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert os.listdir(tmp_path / "swap") == []


CLOSED_FDS = textwrap.dedent(
    """
    import os, sys
    from offload_trainer.app.std_streams import open_closed_std_fds
    was_none = sys.stdout is None and sys.stderr is None
    open_closed_std_fds()
    f = open(sys.argv[1], "w")
    print("to stdout"); print("to stderr", file=sys.stderr); os.write(2, b"from C")
    f.write(str(was_none)); f.close()
    """
)


def test_closed_descriptors_are_pointed_at_dev_null_before_anything_is_opened(tmp_path: Path) -> None:
    target = tmp_path / "file.txt"

    def close_std_fds() -> None:
        os.close(1)
        os.close(2)

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-c", CLOSED_FDS, str(target)], preexec_fn=close_std_fds, env=env, timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0
    assert target.read_text() == "True"  # Python had no streams; what they got went to /dev/null, not here


def test_offload_train_with_stdout_closed_runs_to_the_end(tmp_path: Path, tiny_run_args: Callable[..., List[str]]) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-m", "offload_trainer", *tiny_run_args()], preexec_fn=lambda: os.close(1), env=env,
        stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert (tmp_path / "out" / "latest").read_text().strip() == "ckpt-000002"


def test_offload_plan_ends_quietly_when_its_reader_went_away(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """`offload-plan | head -1`: exit 2 and "Broken pipe; check the path" before; now the status of a
    program killed by SIGPIPE, and nothing on stderr."""
    from offload_trainer.app import plan_cli
    from offload_trainer.app.std_streams import EXIT_STDOUT_GONE

    read_end, write_end = os.pipe()
    os.close(read_end)
    broken = open(write_end, "w")
    monkeypatch.setattr(sys, "stdout", broken)
    try:
        status = plan_cli.main(["--model.preset", "tiny", "--tiers.nvme_dir", str(tmp_path), "--no-measure"])
    finally:
        broken.close()
    assert status == EXIT_STDOUT_GONE == 141
    assert capfd.readouterr().err == ""


def _latin1_dir(tmp_path: Path) -> Path:
    """A directory whose name is Latin-1 bytes, not UTF-8 (b"caf\\xe9"): Python names it with a surrogate."""
    path = Path(os.fsdecode(os.path.join(os.fsencode(tmp_path), b"caf\xe9")))
    try:
        path.mkdir()
    except OSError as exc:  # a file system that takes UTF-8 names only
        pytest.skip(f"this file system refuses a name that is not UTF-8 ({exc})")
    return path


def _strict_stdout(monkeypatch: pytest.MonkeyPatch) -> io.TextIOWrapper:
    """sys.stdout as under a locale such as en_US.UTF-8: UTF-8 with the "strict" error handler
    (C and C.UTF-8, this machine's, give "surrogateescape", which writes such a name's bytes)."""
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)
    monkeypatch.setattr(sys, "stdout", stdout)
    return stdout


def _written(stdout: io.TextIOWrapper) -> str:
    return stdout.buffer.getvalue().decode("utf-8")  # type: ignore[attr-defined]


def test_offload_train_prints_a_path_that_is_not_utf8_escaped_and_runs_to_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture, tiny_run_args: Callable[..., List[str]]
) -> None:
    """The first progress line naming such a path ("tokenizing /data/caf\\udce9...") raised
    UnicodeEncodeError, and the run ended with exit 2 and "'utf-8' codec can't encode character"."""
    where = _latin1_dir(tmp_path)
    args = tiny_run_args("--data.path", str(where / "corpus"), "--train.out_dir", str(where / "out"),
                         "--tiers.nvme_dir", str(where / "swap"))
    (where / "corpus").mkdir()
    (where / "corpus" / "a.py").write_bytes((tmp_path / "corpus" / "a.py").read_bytes())
    stdout = _strict_stdout(monkeypatch)
    status = cli.main(args)
    assert status == 0, capfd.readouterr().err
    assert "saving /" in _written(stdout) and "caf\\udce9/out/ckpt-000002" in _written(stdout)
    assert (where / "out" / "latest").read_text().strip() == "ckpt-000002"


def test_offload_plan_prints_a_path_that_is_not_utf8_escaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """offload-plan's title names the model by its path: exit 2 and "'utf-8' codec can't encode"."""
    from offload_trainer.app import plan_cli

    transformers = pytest.importorskip("transformers")
    hf = _latin1_dir(tmp_path)
    transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    ).save_pretrained(hf)
    stdout = _strict_stdout(monkeypatch)
    status = plan_cli.main(["--hf-config", str(hf / "config.json"), "--tiers.nvme_dir", str(tmp_path), "--no-measure"])
    assert status == 0, capfd.readouterr().err
    assert "caf\\udce9" in _written(stdout)
