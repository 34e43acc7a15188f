"""Numerical tolerances by dtype, shared by every test."""

import jax.numpy as jnp

# Logits against transformers: float32 must agree to 1e-4 (the acceptance bound).
LOGITS_ATOL = {jnp.float32: 1e-4, jnp.bfloat16: 0.25}
# Our own two paths (cached decode vs full forward) run the same math in another order.
SELF_ATOL = {jnp.float32: 2e-5, jnp.bfloat16: 0.1}
