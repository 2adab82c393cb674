"""Blocked Shampoo: the transformation and its block placement (re-exported by :mod:`vescale_jax.optim`)."""
