"""lowcomm_jax: low-communication training of language models on unequal, poorly connected hosts."""

__version__ = "0.1.0"
