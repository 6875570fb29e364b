"""What a point reads of a ``DeviceMesh``, read once per mesh.

On the pinned torch (2.11 on the GPU image, 2.13 here) ``DeviceMesh.mesh`` is rebuilt from the mesh's layout on
every access (``_mesh_layout.remap_to_tensor``: ~0.15 ms), and a point of an FSDP2 model asks it for each of its
parameters: 978 reads took 166 ms of 6 points' 524 ms on 2 x H200 (cProfile, the Llama-3.2-1B shape). A mesh does
not change once made, so its grid, this rank's coordinate, its dim names and its shape are kept here, by the mesh
object (held, so its id is never reused while cached).
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Facts(NamedTuple):
    grid: Any  # the mesh's rank grid, a CPU tensor
    coord: tuple[int, ...] | None  # this rank's coordinate; None where this rank is not in the mesh
    names: tuple[str, ...]  # the dim names, ``dim0``... where the mesh has none
    shape: tuple[int, ...]


_FACTS: dict[int, tuple[Any, Facts]] = {}
_LIMIT = 256  # meshes a process keeps facts of (a job makes a handful)


def of(mesh: Any) -> Facts:
    hit = _FACTS.get(id(mesh))
    if hit is not None and hit[0] is mesh:
        return hit[1]
    grid = mesh.mesh
    coord = mesh.get_coordinate()
    names = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(grid.ndim)))
    facts = Facts(grid, None if coord is None else tuple(coord), names, tuple(grid.shape))
    if len(_FACTS) >= _LIMIT:
        _FACTS.clear()
    _FACTS[id(mesh)] = (mesh, facts)
    return facts


def ranks(mesh: Any) -> tuple[int, ...]:
    return tuple(int(r) for r in of(mesh).grid.flatten().tolist())
