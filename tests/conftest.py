import pytest
import torch._dynamo


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
