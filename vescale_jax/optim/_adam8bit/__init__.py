"""8-bit AdamW: the transformation and the static tables it is built on (re-exported by :mod:`vescale_jax.optim`)."""
