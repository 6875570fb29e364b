"""A cycle in a wait-for graph: the shape of every deadlock proof, in a rank's own watcher (``job/triggers``) and
in the client reading live ledgers (``analysis/deadlock``). Pure Python: the job side imports no pandas."""

from __future__ import annotations


def cycle(waits: dict[int, list[int]]) -> list[int]:
    """The ranks of one cycle in the wait-for graph (rank -> the ranks it waits for), sorted; empty when none."""
    state: dict[int, int] = {}  # 1: on the path, 2: done

    def visit(r: int, path: list[int]) -> list[int]:
        state[r] = 1
        path.append(r)
        for p in waits.get(r, []):
            if state.get(p) == 1:
                return path[path.index(p):]
            if p not in state:
                found = visit(p, path)
                if found:
                    return found
        path.pop()
        state[r] = 2
        return []

    for r in sorted(waits):
        if r not in state:
            found = visit(r, [])
            if found:
                return sorted(found)
    return []
