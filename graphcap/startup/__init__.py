"""Kernel start-up, apart from the capture core: validated kernel choices (``tuning``), Triton
compiles ahead of their first launch (``compile_ahead``) and the on-disk JIT caches
(``jit_cache``)."""
