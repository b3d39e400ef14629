"""Checks that a graph does what eager does: comparisons (``compare``), replay vs eager per
graph after capture (``replay_checks``: validation and frozen-value detection, with
``frozen``, ``graph_nodes`` and ``kernel_types``), and sampled audits while serving (``audit``)."""
