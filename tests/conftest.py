import pytest

torch = pytest.importorskip("torch")


@pytest.fixture
def gen():
    """A fresh, seeded generator per test: random inputs, reproducible failures."""
    g = torch.Generator()
    g.manual_seed(torch.seed() % (2**31))
    return g


# The first torch.optim optimizer a process builds imports torch._dynamo
# (seconds). Build one here so every forked test rank inherits the imports.
torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
