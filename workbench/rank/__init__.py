"""What runs inside a rank: probe, materialisation helpers, per-rank context, tiny models.

Nothing in this package imports the client layer, plotly or IPython: it is what an
ipyparallel engine (or a plain ``torchrun`` worker) loads. It imports only ``rank/``,
``workbench.errors`` and ``workbench.scenario`` (tests/test_layout.py checks).
"""
