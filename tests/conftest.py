"""Test configuration.

Without a CUDA GPU the Triton kernels run through Triton's interpreter
(``TRITON_INTERPRET=1``), which must be set before any kernel module is
imported; with a GPU they are compiled.  Tests marked ``gpu`` need a GPU and
are skipped without one (run them with ``pytest -m gpu`` on the device);
tests marked ``multigpu`` are skipped with fewer than 2 GPUs.
"""

import os

import pytest
import torch
from hypothesis import settings

# CI replays the same examples every run (a red CI then means a real regression, not a new draw);
# locally hypothesis keeps exploring.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

if os.environ.get("TRITON_INTERPRET") is None and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

HAS_GPU = torch.cuda.is_available()


def pytest_addoption(parser):
    parser.addoption(
        "--per-test", type=int, default=0, metavar="N",
        help="keep at most N parametrizations of each test function (a deterministic sample: a device call's time "
             "covers every test function once instead of the first hundreds of cases); 0 keeps all")
    parser.addoption("--sample-seed", type=int, default=0,
                     help="which sample --per-test keeps (another seed, other cases)")


def sample_per_test(items, n: int, seed: int):
    """(kept, dropped): at most ``n`` items per test function (module + function name), the ones whose
    ``sha256(seed, nodeid)`` is smallest, in collection order."""
    import hashlib

    groups: dict = {}
    for item in items:
        groups.setdefault((item.module.__name__ if item.module else "", item.originalname), []).append(item)
    chosen = set()
    for group in groups.values():
        rank = sorted(group, key=lambda it: hashlib.sha256(f"{seed}:{it.nodeid}".encode()).hexdigest())
        chosen.update(id(it) for it in rank[:n])
    return [it for it in items if id(it) in chosen], [it for it in items if id(it) not in chosen]


def pytest_collection_modifyitems(config, items):
    n = config.getoption("--per-test")
    if n > 0:
        kept, dropped = sample_per_test(items, n, config.getoption("--sample-seed"))
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
    skip_multi = pytest.mark.skip(reason="needs 2 or more CUDA GPUs (run `pytest -m multigpu` on a multi-GPU machine)")
    if torch.cuda.device_count() < 2:
        for item in items:
            if "multigpu" in item.keywords:
                item.add_marker(skip_multi)
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    """Where kernels run: the GPU when present, else the CPU through the interpreter."""
    return "cuda" if HAS_GPU else "cpu"


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Each test plans its own signatures (flashtile.ops.plan), under whatever it patches."""
    from flashtile.ops import plan

    plan.clear()
    yield
