"""The ``--per-test N`` collection sample of tests/conftest.py (device calls run every test function's few cases)."""

from __future__ import annotations

from types import SimpleNamespace

from tests.conftest import sample_per_test


def _items():
    mod_a, mod_b = SimpleNamespace(__name__="a"), SimpleNamespace(__name__="b")
    items = [SimpleNamespace(module=mod_a, originalname="test_x", nodeid=f"a.py::test_x[{i}]") for i in range(10)]
    items += [SimpleNamespace(module=mod_a, originalname="test_y", nodeid="a.py::test_y")]
    items += [SimpleNamespace(module=mod_b, originalname="test_x", nodeid=f"b.py::test_x[{i}]") for i in range(3)]
    return items


def test_at_most_n_per_function_in_collection_order():
    items = _items()
    kept, dropped = sample_per_test(items, 2, seed=0)
    assert len(kept) == 2 + 1 + 2 and len(dropped) == len(items) - 5
    assert [it.originalname for it in kept].count("test_y") == 1
    assert sum(it.module.__name__ == "b" for it in kept) == 2  # same function name, other module: its own group
    assert kept == [it for it in items if it in kept]  # order kept
    assert set(map(id, kept)) | set(map(id, dropped)) == set(map(id, items))


def test_the_sample_is_deterministic_and_moves_with_the_seed():
    items = _items()
    first = [it.nodeid for it in sample_per_test(items, 3, seed=0)[0]]
    assert first == [it.nodeid for it in sample_per_test(items, 3, seed=0)[0]]
    others = {tuple(it.nodeid for it in sample_per_test(items, 3, seed=s)[0]) for s in range(1, 8)}
    assert len(others - {tuple(first)}) >= 1
