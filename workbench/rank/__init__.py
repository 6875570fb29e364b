"""What runs inside a rank: the instrumentation (probe, ledger, poison, trace, control path, per-rank context).

Nothing in this package imports the client layer, plotly or IPython: it is what an
ipyparallel engine (or a plain ``torchrun`` worker) loads. It imports only ``rank/``,
``workbench.errors`` and ``workbench.scenario``; never ``lab/``, the models and roles a
scenario is built from, which imports this package (tests/test_layout.py checks).
"""
