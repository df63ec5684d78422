import pytest
import torch._dynamo


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: cached frames from another test would hide bugs."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
