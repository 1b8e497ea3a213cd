"""Session-wide test setup: the planner's per-machine cache lives in a temporary directory."""

import pytest


@pytest.fixture(autouse=True, scope="session")
def _private_rates_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    # Tests must not read or write the user's ~/.cache/offload-trainer (machine.default_cache_path).
    mp = pytest.MonkeyPatch()
    mp.setenv("OFFLOAD_TRAINER_CACHE", str(tmp_path_factory.mktemp("rates") / "machine.json"))
    yield
    mp.undo()
