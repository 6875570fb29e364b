"""Tiny real transformers models from configs: no hub, deterministic weights.

Every rank can rebuild the same checkpoint from a seed, so a rank needs no shared disk to
hold the reference, and ``from_pretrained`` runs the loader code path the incident took.
torch and transformers are imported inside the functions: scenario declarations read
``QWEN3_SHAPE`` on the client, which never builds a model.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

QWEN3_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,  # >= 64: a tiny head_dim shows the dtype change but not the NaN
    "vocab_size": 512,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 256,
}


def qwen3_config(**shape: Any):
    from transformers import Qwen3Config

    kw = {**QWEN3_SHAPE, **{k: v for k, v in shape.items() if k in QWEN3_SHAPE}}
    # Eager attention: CPU SDPA returns finite output for all-NaN q/k and hides the bug.
    return Qwen3Config(tie_word_embeddings=False, attn_implementation="eager", **kw)


# The last checkpoint this process wrote, as bytes, with the torch RNG state its build left: a rerun of a scenario
# on warm ranks (a new session, so a new work dir) writes the same files again instead of building and
# serialising the seeded model anew (a sixth of a warm rerun's rank time on the headline). In memory only.
_LAST: dict[str, Any] = {}
_LAST_MAX_BYTES = 64 << 20


def save_checkpoint(config, directory: str, seed: int = 0) -> str:
    """Write a seeded random-init checkpoint (fp32 safetensors) and return its path.

    Written by hand: ``save_pretrained`` silently writes nothing on ranks other than 0
    once a process group exists, and every rank here keeps its own copy. The same config and seed
    as this process's last checkpoint give the same bytes, written from memory; the RNG is left as
    the build would leave it.
    """
    import torch

    marker = os.path.join(directory, "config.json")
    weights = os.path.join(directory, "model.safetensors")
    if os.path.exists(marker):
        return directory
    os.makedirs(directory, exist_ok=True)
    key = (config.to_json_string(), seed)
    if _LAST.get("key") == key:
        torch.manual_seed(seed)
        torch.random.set_rng_state(_LAST["rng"])
        with open(weights, "wb") as f:
            f.write(_LAST["weights"])
        with open(marker, "w") as f:  # last: its presence means the checkpoint is whole
            f.write(_LAST["config"])
        return directory
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    _LAST.clear()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    save_file(state, weights, metadata={"format": "pt"})
    config.to_json_file(marker)  # last: its presence means the checkpoint is whole
    if os.path.getsize(weights) <= _LAST_MAX_BYTES:
        with open(weights, "rb") as f, open(marker) as g:
            _LAST.update(key=key, rng=rng, weights=f.read(), config=g.read())
    return directory


def load_pretrained(directory: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="eager")
    return model.to(device).eval()


def build_on_meta(config, dtype: torch.dtype | None = None):
    """The model of ``config`` on the meta device (eager attention, eval mode): shapes and dtypes, no memory.
    ``dtype``: the weights' dtype (default: what ``from_config`` picks); buffers computed in ``__init__``
    (rotary ``inv_freq``) keep their own."""
    import torch
    from transformers import AutoModelForCausalLM

    kw = {} if dtype is None else {"dtype": dtype}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager", **kw).eval()


def token_batch(vocab_size: int, seq_len: int, seed: int, device: torch.device) -> torch.Tensor:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (1, seq_len), generator=g).to(device)


def warm_first_calls() -> float | None:
    """Run, once and on a throwaway tiny Qwen3, what a catalogue scenario's first steps run: write a seeded
    checkpoint, ``from_pretrained`` it in bf16, build the config on meta, one forward; then drop it all.
    ``workbench up`` calls this on its ranks after the imports, so the first run attached to them does not pay
    first-call costs (transformers compiles its checkpoint-conversion patterns on the first ``from_pretrained``;
    the first module construction and forward warm torch's paths): measured on the 2-core box, a first run's
    ``load`` and ``forward`` steps took 2-3x their later times without it. The torch RNG state is put back, so a
    run on warm ranks draws what it would on fresh ones. Returns the seconds it took (None: it failed)."""
    import tempfile
    import time

    import torch

    t0 = time.perf_counter()
    rng = torch.random.get_rng_state()
    try:
        with tempfile.TemporaryDirectory(prefix="wb-warm-") as d:
            config = qwen3_config()
            model = load_pretrained(save_checkpoint(config, d), torch.bfloat16, torch.device("cpu"))
            build_on_meta(config)
            with torch.no_grad():
                model(input_ids=token_batch(config.vocab_size, 8, 0, torch.device("cpu")))
    except (OSError, ImportError, RuntimeError, ValueError, TypeError, AttributeError, KeyError):
        # best effort, like the imports' warm-up: no transformers, a version whose config or loader differs, no
        # temp space; a scenario that cannot build says so itself
        return None
    finally:
        torch.random.set_rng_state(rng)
    return time.perf_counter() - t0
