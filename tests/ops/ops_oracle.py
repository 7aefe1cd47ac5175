"""The ops tests' names for the one oracle and tolerance table of :mod:`tests._oracle`.

``attention64`` is :func:`tests._oracle.attention_ref` (q, k, v in (B, H, N, d), float64),
``grads64`` is :func:`tests._oracle.grads_ref`, ``tolerance`` and ``assert_close64``
are the table's entry and its comparison.
"""

from __future__ import annotations

from tests._oracle import assert_close as assert_close64
from tests._oracle import attention_ref as attention64
from tests._oracle import grads_ref as grads64
from tests._oracle import tolerance

__all__ = ["assert_close64", "attention64", "grads64", "tolerance"]
