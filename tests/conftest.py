"""Session-wide test setup: the planner's per-machine cache lives in a temporary directory, and the
tests run on the CPU even on a machine with a GPU, but for those marked `cuda`.

[Note: The test suite on a GPU machine]
Most tests compare the engine with plain PyTorch on the CPU, bitwise, and give it the CPU's
tensors; the engine's default device (initialize(..., device=None), offload-train, the planner) is
the GPU where there is one. So on a GPU machine `python3 -m pytest` ran them on the GPU: inputs on
the wrong device, and results that a GPU's kernels make differently. The suite hides the GPU for
the session (torch.cuda.is_available() says False in this process, CUDA_VISIBLE_DEVICES="" for the
processes the tests start: offload-train runs, ranks), as on CI, and gives it back to the tests
marked `cuda` (which name their device), one at a time. The CUDA runtime has read the real
variable before it is changed (is_available() is called first), so those tests still find it."""

import os

import pytest
import torch

_REAL_IS_AVAILABLE = torch.cuda.is_available
_REAL_VISIBLE = os.environ.get("CUDA_VISIBLE_DEVICES")
_REAL_IS_AVAILABLE()  # here, so that the CUDA runtime starts with the real device list


@pytest.fixture(autouse=True, scope="session")
def _private_rates_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    # Tests must not read or write the user's ~/.cache/offload-trainer (machine.default_cache_path).
    mp = pytest.MonkeyPatch()
    mp.setenv("OFFLOAD_TRAINER_CACHE", str(tmp_path_factory.mktemp("rates") / "machine.json"))
    yield
    mp.undo()


@pytest.fixture(autouse=True, scope="session")
def _gpu_hidden() -> None:
    """[Note: The test suite on a GPU machine]: the CPU for every test not marked `cuda`."""
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_available", lambda: False)
    mp.setenv("CUDA_VISIBLE_DEVICES", "")
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _gpu_for_cuda_tests(request: pytest.FixtureRequest, _gpu_hidden: None) -> None:
    """A test marked `cuda` sees the machine's GPU (and so do the processes it starts)."""
    if request.node.get_closest_marker("cuda") is None:
        yield
        return
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_available", _REAL_IS_AVAILABLE)
    if _REAL_VISIBLE is None:
        mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        mp.setenv("CUDA_VISIBLE_DEVICES", _REAL_VISIBLE)
    yield
    mp.undo()


@pytest.fixture
def one_torch_thread() -> None:
    """Tiny models on a shared 2-core machine: one torch thread is many times faster than two. A test
    file takes it for all its tests with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
