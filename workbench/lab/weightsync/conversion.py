"""Conversion tasks and the exporting extractor on the trainer ranks (Megatron-Bridge-like).

Exporting HF-named weights from a model-parallel trainer is itself collective work, so
every trainer rank must walk the export in lockstep:

- an **expert task** (one local expert's weight on an expert-parallel rank) all-gathers
  that weight over the EP group: the output is EP times its input, and yields one
  HF-named tensor per EP rank's copy of that local expert;
- a **dense task** runs the mapping's ``broadcast_from_pp_rank``: on the first call the
  mapping all-gathers every stage's tensor spec (shape, dtype) as objects and caches it
  (``_tensor_spec_output_cache``); later calls skip that collective, non-owners allocate
  ``torch.empty(shape, dtype)`` from the cached spec and receive the owner's broadcast.

``WeightConversionTask`` is frozen and holds its mapping, so a task list built once and
reused keeps every mapping's cache across syncs (the stale-cache incident);
``get_conversion_tasks`` builds fresh mappings every call.

The toy mesh folds both parallelisms onto the same trainer ranks: the routed experts of
every MoE layer are split over all ranks (EP = ranks), and the dense parameters are split
into pipeline stages (PP = ranks: stage 0 holds the embedding and the first layers, the
last stage the last layers, the final norm and the LM head). A real Megatron mesh needs
PP x EP ranks for this; the collectives each rank issues per task are the same kinds.

``ConversionExtractor`` is SkyRL's ``MegatronWeightExtractor`` in small: buckets of task
indices (expert tasks first), ``extract_weights`` regrouping each bucket by output dtype
(fp32 for routing-critical suffixes), and three ways to build the receiver's metadata
(``metadata=``): ``"raw"`` (raw export order, the PR #1816 state), ``"mirrored-local"``
(the mirrored regrouping, decided from the dtype of tensors this rank owns: a rank that
owns an fp32 tensor of the bucket walks the bucket once per output dtype, the others once)
and ``"one-plan"`` (one chunk-plan generator feeds both metadata and stream).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from workbench.errors import WorkbenchError
from workbench.lab.weightsync import model as model_mod
from workbench.lab.weightsync import pack
from workbench.lab.weightsync.defaults import DEFAULT_BUCKET_BYTES, TOY_SHAPE  # noqa: F401  (re-exported)
from workbench.lab.weightsync.pack import dtype_name
from workbench.rank.ledger import label

METADATA_MODES = ("raw", "mirrored-local", "one-plan")

toy_config = model_mod.tiny_config
vllm_config = model_mod.vllm_config
build_model = model_mod.build_model
router_biases = model_mod.router_biases
load_hf_weight = model_mod.load_hf_weight
hf_tensors = model_mod._raw  # parameters in model order, each router bias right after its gate


def sync_dtype_for(name: str, default: torch.dtype, native: torch.dtype | None) -> torch.dtype:
    """Part 1's rule (routing-critical suffixes keep their native dtype); ``native=None``: a rank that
    does not hold the tensor cannot know it and falls back to ``default``."""
    return default if native is None else pack.sync_dtype_for(name, default, native, pack.ROUTING_SUFFIXES)


def hf_state(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What a correct sync delivers: every HF name (experts one by one) in its sync dtype."""
    return {n: t.to(sync_dtype_for(n, dtype, t.dtype)) for n, t in model_mod.hf_state(model).items()}


# -- mesh, mappings, tasks ------------------------------------------------------------------
@dataclass
class Mesh:
    """The trainer ranks: this rank's pipeline stage and expert-parallel rank (folded: both = rank)."""

    rank: int
    size: int
    num_layers: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: Any = None

    def stage_of(self, name: str) -> int:
        if name.startswith("model.embed_tokens"):
            return 0
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m:
            return int(m.group(1)) * self.size // self.num_layers
        return self.size - 1  # final norm, LM head


class ParamMapping:
    """A dense parameter's mapping; caches the pipeline broadcast's tensor spec after the first call."""

    def __init__(self, hf_name: str, mesh: Mesh):
        self.hf_name = hf_name
        self.mesh = mesh
        self._tensor_spec_output_cache: dict[str, list[Any]] = {}
        self._syncs = 0  # broadcasts so far: a task's mapping broadcasts once per weight sync
        self._cached_at: dict[str, int] = {}  # cache key -> the sync whose spec it holds

    def broadcast_from_pp_rank(self, tensor: torch.Tensor | None, cache_key: str | None = None) -> torch.Tensor:
        m = self.mesh
        self._syncs += 1
        if cache_key is not None and cache_key in self._tensor_spec_output_cache:
            specs = self._tensor_spec_output_cache[cache_key]  # no collective: the spec of the first call
            origin = f"the spec cached at sync {self._cached_at[cache_key]}"
        else:
            spec = None if tensor is None else (tuple(tensor.shape), tensor.dtype)
            specs = [None] * m.size
            dist.all_gather_object(specs, spec, group=m.group)
            if cache_key is not None:
                self._tensor_spec_output_cache[cache_key] = specs
                self._cached_at[cache_key] = self._syncs
            origin = "the spec just gathered"
        src = next((r for r, s in enumerate(specs) if s is not None), None)
        if src is None:
            raise WorkbenchError(f"no pipeline stage holds {self.hf_name!r}")
        if tensor is None:
            shape, dtype = specs[src]
            tensor = torch.empty(shape, dtype=dtype, device=m.device)
            why = f"conversion task for `{self.hf_name}` receives per {origin}: {dtype_name(dtype)} {list(shape)}"
        else:
            tensor = tensor.detach().contiguous()
            why = (f"conversion task for `{self.hf_name}`: the owner sends its current "
                   f"{dtype_name(tensor.dtype)} {list(tensor.shape)}")
        with label(why):  # a stale cached spec then reads as the cause of a mismatch, in the ledger's words
            dist.broadcast(tensor, src=src, group=m.group)
        return tensor


class ExpertMapping(ParamMapping):
    """A local expert's weight: all-gathered over the expert-parallel group on every call."""

    def gather_from_ep_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        m = self.mesh
        local = tensor.detach().contiguous().view(-1)
        out = torch.empty(m.size * local.numel(), dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(out, local, group=m.group)
        return out.view(m.size, *tensor.shape)


@dataclass(frozen=True)
class WeightConversionTask:
    """One exported weight: its trainer-side name, owner stage, mapping and (if local) the tensor."""

    param_name: str
    global_param_name: str
    mapping: ParamMapping
    pp_rank: int  # owner stage; -1: expert-parallel (every rank holds its own experts)
    param_weight: torch.Tensor | None
    numel: int
    local_expert: int | None = None

    @property
    def is_expert(self) -> bool:
        return self.local_expert is not None

    def hf_names(self, ep_size: int, experts_per_rank: int) -> list[str]:
        if not self.is_expert:
            return [self.global_param_name]
        prefix, w = self.global_param_name.rsplit(".", 1)
        return [f"{prefix}.{r * experts_per_rank + self.local_expert}.{w}" for r in range(ep_size)]


def get_conversion_tasks(model: torch.nn.Module, mesh: Mesh) -> list[WeightConversionTask]:
    """Fresh tasks with fresh mappings (empty caches), in the model's raw order."""
    tasks = []
    for name, t in hf_tensors(model):
        if name.endswith(model_mod.FUSED):
            n_local = t.shape[0] // mesh.size
            for i in range(n_local):
                local = t[mesh.rank * n_local + i]
                tasks.append(WeightConversionTask(f"{name}.local{i}", name, ExpertMapping(name, mesh), -1, local,
                                                  local.numel() * mesh.size, local_expert=i))
        else:
            stage = mesh.stage_of(name)
            tasks.append(WeightConversionTask(name, name, ParamMapping(name, mesh), stage,
                                              t if stage == mesh.rank else None, t.numel()))
    return tasks


def export_hf_weights(tasks: list[WeightConversionTask], mesh: Mesh,
                      experts_per_rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors of ``tasks``, issuing each task's collectives as it goes."""
    for task in tasks:
        if task.is_expert:
            gathered = task.mapping.gather_from_ep_ranks(task.param_weight)
            yield from zip(task.hf_names(mesh.size, experts_per_rank), gathered.unbind(0))
        else:
            yield task.global_param_name, task.mapping.broadcast_from_pp_rank(task.param_weight,
                                                                              cache_key=task.global_param_name)


def bucket_index_groups(tasks: list[WeightConversionTask], bucket_bytes: int, itemsize: int = 2) -> list[list[int]]:
    """Task indices per bucket: expert tasks first (one layer's experts never split), then the rest."""
    experts = [i for i, t in enumerate(tasks) if t.is_expert]
    dense = [i for i, t in enumerate(tasks) if not t.is_expert]
    units: list[list[int]] = []
    for i in experts:
        layer = tasks[i].global_param_name.split(".experts")[0]
        if units and tasks[units[-1][0]].global_param_name.split(".experts")[0] == layer:
            units[-1].append(i)
        else:
            units.append([i])
    units += [[i] for i in dense]
    groups: list[list[int]] = [[]]
    size = 0
    for unit in units:
        n = sum(tasks[i].numel for i in unit) * itemsize
        if groups[-1] and size + n > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].extend(unit)
        size += n
    return [g for g in groups if g]


@dataclass
class WeightChunk:
    """SkyRL's chunk: equal-length lists; one dtype per chunk here."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    tensors: list[torch.Tensor]


class ConversionExtractor:
    """Buckets of conversion tasks, exported into chunks for the sender, and the receiver's metadata."""

    def __init__(self, model: torch.nn.Module, mesh: Mesh, dtype: torch.dtype = torch.bfloat16,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, reuse_tasks: bool = False, metadata: str = "raw"):
        if metadata not in METADATA_MODES:
            raise WorkbenchError(f"unknown metadata mode {metadata!r}; valid: {', '.join(METADATA_MODES)}")
        self.model, self.mesh, self.dtype = model, mesh, dtype
        self.bucket_bytes, self.reuse_tasks, self.metadata_mode = bucket_bytes, reuse_tasks, metadata
        self.bucket_index_groups: list[list[int]] | None = None
        self._tasks: list[WeightConversionTask] | None = None
        self.last_tasks: list[WeightConversionTask] = []  # the tasks the latest walk used
        self.experts_per_rank = model.config.n_routed_experts // mesh.size
        self.task_builds = 0

    # the incident's two task policies
    def tasks(self) -> list[WeightConversionTask]:
        """Reused: built once, mappings (and their caches) live on. Else: fresh every call."""
        if self.reuse_tasks and self._tasks is not None:
            self.last_tasks = self._tasks
            return self._tasks
        tasks = get_conversion_tasks(self.model, self.mesh)
        self.last_tasks = tasks
        self.task_builds += 1
        if self.bucket_index_groups is None:
            self.bucket_index_groups = bucket_index_groups(tasks, self.bucket_bytes)
        if self.reuse_tasks:
            self._tasks = tasks
        return tasks

    def _export(self, tasks: list[WeightConversionTask]) -> Iterator[tuple[str, torch.Tensor]]:
        return export_hf_weights(tasks, self.mesh, self.experts_per_rank)

    def _buckets(self) -> Iterator[list[WeightConversionTask]]:
        tasks = self.tasks()
        for group in self.bucket_index_groups:
            yield [tasks[i] for i in group]

    # the stream
    def extract_weights(self) -> Iterator[WeightChunk]:
        """Per bucket: export, group by output dtype (first seen first), one chunk per dtype."""
        yield from (c for c in self.iter_chunk_plan(materialize=True) if c.tensors)

    def iter_chunk_plan(self, materialize: bool) -> Iterator[WeightChunk]:
        """Per bucket, per output dtype: one chunk. ``extract_weights`` streams it; under ``one-plan``
        the metadata reads it too (without tensors), so the two cannot disagree."""
        for bucket in self._buckets():
            groups: dict[torch.dtype, WeightChunk] = {}
            for name, t in self._export(bucket):
                out = sync_dtype_for(name, self.dtype, t.dtype)
                c = groups.setdefault(out, WeightChunk([], [], [], []))
                c.names.append(name)
                c.dtypes.append(dtype_name(out))
                c.shapes.append(list(t.shape))
                if materialize:
                    c.tensors.append(t.to(out))
            yield from groups.values()

    # the receiver's plan
    def get_weight_metadata(self) -> dict[str, list[Any]]:
        names: list[str] = []
        dtypes: list[str] = []
        shapes: list[list[int]] = []

        def add(name: str, out: torch.dtype, t: torch.Tensor) -> None:
            names.append(name)
            dtypes.append(dtype_name(out))
            shapes.append(list(t.shape))

        if self.metadata_mode == "one-plan":
            for c in self.iter_chunk_plan(materialize=False):
                names += c.names
                dtypes += c.dtypes
                shapes += c.shapes
        elif self.metadata_mode == "raw":
            for bucket in self._buckets():
                for name, t in self._export(bucket):
                    add(name, sync_dtype_for(name, self.dtype, t.dtype), t)
        else:  # mirrored-local
            for bucket in self._buckets():
                seen = self.local_out_dtypes(bucket)
                if len(seen) == 1:  # no second dtype seen here: raw order, one walk
                    for name, t in self._export(bucket):
                        add(name, sync_dtype_for(name, self.dtype, t.dtype), t)
                    continue
                # the mirrored regrouping, one walk per output dtype keeping that dtype's names
                for out_dtype in seen:
                    for name, t in self._export(bucket):
                        out = sync_dtype_for(name, self.dtype, t.dtype)
                        if out == out_dtype:
                            add(name, out, t)
        return {"names": names, "dtype_names": dtypes, "shapes": shapes}

    def local_out_dtypes(self, bucket: list[WeightConversionTask]) -> list[torch.dtype]:
        """Output dtypes of a bucket as this rank sees them: only tensors it owns show their dtype."""
        seen: list[torch.dtype] = [self.dtype]
        for task in bucket:
            native = None if task.param_weight is None else task.param_weight.dtype
            out = sync_dtype_for(task.global_param_name, self.dtype, native)
            if out not in seen:
                seen.append(out)
        return seen
