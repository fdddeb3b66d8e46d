import pytest

torch = pytest.importorskip("torch")


@pytest.fixture
def gen():
    """A fresh, seeded generator per test: random inputs, reproducible failures."""
    g = torch.Generator()
    g.manual_seed(torch.seed() % (2**31))
    return g
