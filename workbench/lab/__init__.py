"""What a scenario is built from: tiny models, FSDP-on-CPU helpers, buffer init paths, the weight-sync roles.

The pieces an incident's steps call where the real stack would call a library: tiny real
``transformers`` models from configs (``models``), a toy MoE (``toy_moe``), the one bend that
lets FSDP1 sync module states on CPU (``fsdp_cpu``), non-persistent buffer init and sync
(``buffers``), and the RL weight sync with its receivers, the workbench's own and vLLM's
(``weightsync``). A new model or receiver goes here; the instrumentation that watches them
(probe, ledger, poison, trace, control) is ``rank/``.

Runs inside a rank like ``rank/``, and imports only ``rank/``, itself and the declarations
(``workbench.errors``, ``workbench.scenario``); ``rank/`` never imports it (tests/test_layout.py).
Nothing here imports torch at package import: scenario declarations read ``models.QWEN3_SHAPE``
and ``weightsync.defaults`` on the client.
"""
