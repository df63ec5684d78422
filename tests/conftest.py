import pytest
import torch._dynamo

TIERS = {"structure", "multirank", "extended", "gpu"}
"""The markers registered in pyproject.toml; `pytest -m <tier>` selects one."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Each test carries exactly one tier marker, checked before `-m` deselects anything: a
    test in no tier would silently drop out of every tier's run, one in two would run twice
    when the tiers run one after another."""
    wrong = [item.nodeid for item in items if len(TIERS & {m.name for m in item.iter_markers()}) != 1]
    if wrong:
        raise pytest.UsageError(
            f"tests not in exactly one of the tiers {sorted(TIERS)} (pytestmark or "
            "@pytest.mark.<tier>):\n  " + "\n  ".join(wrong)
        )


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: cached frames from another test would hide bugs."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


from hypothesis import settings  # noqa: E402

# Property-based parity spawns real ranks per example: CI runs a few, `pytest
# --hypothesis-profile=long` runs many.
settings.register_profile("ci", max_examples=4, deadline=None, derandomize=True)
settings.register_profile("long", max_examples=60, deadline=None)
settings.load_profile("ci")
