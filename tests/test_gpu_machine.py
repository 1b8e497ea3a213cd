"""The suite on a machine with a GPU ([Note: The test suite on a GPU machine] in tests/conftest.py):
a GPU is stood in for (torch.cuda.is_available() says True before the suite's conftest loads) and
a small suite of two tests runs under tests/conftest.py in a pytest of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

FAKE_GPU = '''
import torch
torch.cuda.is_available = lambda: True
'''

INNER = '''
import os
import pytest
import torch
from offload_trainer.runtime.device.choose import accelerator_for


def test_plain():
    assert not torch.cuda.is_available()
    assert accelerator_for(None).torch_device.type == "cpu"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.cuda
def test_on_the_gpu():
    assert torch.cuda.is_available()
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == "3"


def test_plain_again():
    assert not torch.cuda.is_available() and os.environ["CUDA_VISIBLE_DEVICES"] == ""
'''


def test_tests_run_on_the_cpu_on_a_gpu_machine_but_those_marked_cuda(tmp_path: Path) -> None:
    """On a GPU machine the engine's default device is the GPU, so tests comparing it with plain
    PyTorch on the CPU ran it there (wrong-device inputs, other kernels' bits)."""
    (tmp_path / "fake_gpu.py").write_text(FAKE_GPU)
    (tmp_path / "test_inner.py").write_text(INNER)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "fake_gpu", "-p", "tests.conftest",
         "-m", "", "--rootdir", str(tmp_path), "-c", "/dev/null", str(tmp_path / "test_inner.py")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}", "CUDA_VISIBLE_DEVICES": "3"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "3 passed" in done.stdout, done.stdout
