import os
import random

import pytest

torch = pytest.importorskip("torch")

SEED_ENV = "ZEROCORE_TEST_SEED"
_SEED = pytest.StashKey[int]()


@pytest.fixture(autouse=True)
def zerocore_seed(request):
    """Each test's random seed: $ZEROCORE_TEST_SEED when set, else a fresh
    one. It seeds torch's global RNG (which forked ranks inherit) and `gen`;
    a failing test's report names it, so the failure can be replayed."""
    value = os.environ.get(SEED_ENV)
    seed = int(value) if value else random.SystemRandom().randrange(2**31)
    request.node.stash[_SEED] = seed
    torch.manual_seed(seed)
    return seed


@pytest.fixture
def gen(zerocore_seed):
    """A generator seeded with the test's seed: random inputs, reproducible failures."""
    return torch.Generator().manual_seed(zerocore_seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    seed = item.stash.get(_SEED, None)
    if report.failed and seed is not None:
        report.sections.append(("zerocore test seed", f"{SEED_ENV}={seed} replays this test's random draws"))


# The first torch.optim optimizer a process builds imports torch._dynamo
# (seconds). Build one here so every forked test rank inherits the imports.
torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
