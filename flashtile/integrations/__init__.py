"""Integrations of flashtile's kernels with other libraries.

* :mod:`flashtile.integrations.transformers` — ``attn_implementation="flashtile"`` for Hugging Face
  transformers models (registered when the module is imported; ``register()`` does it explicitly).

Nothing here is imported by ``import flashtile``: each integration imports its library.
"""
