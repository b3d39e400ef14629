"""Models built on graphcap: each one a subpackage (``models.minimax_m3``)."""
