"""Model layer: a NemotronH-format hybrid (Mamba2 / attention / MLP) decoder over paged caches.

See README.md for the module map and the forward contract the engine codes against.
"""
