"""What a rank imports to be ready, and what a warm one has imported beyond it.

Torch-free at import, so the client can name them (``workbench up`` hands ``WARM_MODULES`` to the engine set,
which imports them once before it forks the engines) and the engine set can import the rank layer without the
client's modules.
"""

import os
import sys

# What the catalogue's first steps import on a rank beyond the rank layer: FSDP, the transformers
# auto classes and the two model families the scenarios build (Qwen3, DeepseekV3). Seconds per engine.
WARM_MODULES: tuple[str, ...] = (
    "torch.distributed.fsdp",
    "transformers.models.auto.modeling_auto",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.deepseek_v3.modeling_deepseek_v3",
)


def import_rank_layer() -> None:
    """torch and the workbench's rank layer, as every engine needs them before its group forms."""
    # An engine is an IPython kernel, so transformers' and the hub's progress bars pick tqdm's notebook widget,
    # which no one sees (an engine's comms reach no front end): ~50 ms of ipywidgets set-up on every
    # from_pretrained a step makes (profiled on a warm CPU rank). Read when huggingface_hub is imported; a user's
    # own setting stands.
    if "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        if "huggingface_hub" in sys.modules:  # imported already (a %%px cell before us): told directly
            sys.modules["huggingface_hub"].utils.disable_progress_bars()
        if "transformers" in sys.modules:
            sys.modules["transformers"].utils.logging.disable_progress_bar()
    import workbench.rank.context  # noqa: F401  (imports torch; on GPUs also initialises CUDA lazily)
