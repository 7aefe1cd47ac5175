"""`flashtile bench attention`'s providers, without a GPU."""

import importlib.util

import pytest
import torch

from flashtile.bench.attention import PROVIDERS, make_providers


def test_fa3_is_an_optional_peer():
    """FA3 is a provider of the default grid, never a dependency: without its interface the column
    is reported unsupported with the reason (the bench catches the error per point)."""
    assert "fa3" in PROVIDERS
    fn = make_providers(["fa3"])["fa3"]
    if importlib.util.find_spec("fa3_fwd_interface") is not None:
        pytest.skip("fa3_fwd_interface is installed here")
    x = torch.zeros(1, 1, 1, 8)
    with pytest.raises(RuntimeError, match="fa3_fwd_interface"):
        fn(x, x, x, False)


def test_unknown_provider_is_named():
    with pytest.raises(ValueError, match="'nope'"):
        make_providers(["nope"])
