"""Who waits for whom, as a graph of ranks: reachability and cycles (pure).

`launcher.hang.causes` builds the graph (an edge from each waiting rank to each rank it waits
for) and asks these questions of it.
"""

from __future__ import annotations

from collections.abc import Mapping


def reachable(needs: Mapping[int, set[int]], start: int) -> set[int]:
    seen, todo = {start}, [start]
    while todo:
        for n in needs.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def reverse(needs: Mapping[int, set[int]]) -> dict[int, set[int]]:
    back: dict[int, set[int]] = {}
    for w, ns in needs.items():
        for n in ns:
            back.setdefault(n, set()).add(w)
    return back


def explained_by(needs: Mapping[int, set[int]], causes: set[int]) -> set[int]:
    """Waiting ranks, not causes themselves, whose chains reach a cause."""
    back, reached, todo = reverse(needs), set(causes), list(causes)
    while todo:
        for w in back.get(todo.pop(), ()):
            if w not in reached:
                reached.add(w)
                todo.append(w)
    return {w for w in needs if w in reached and w not in causes}


def components(graph: Mapping[int, set[int]]) -> list[set[int]]:
    """Strongly connected components (Kosaraju, iterative: chains can be thousands long)."""
    order: list[int] = []
    seen: set[int] = set()
    for start in graph:
        if start in seen:
            continue
        seen.add(start)
        stack = [(start, iter(graph.get(start, ())))]
        while stack:
            node, it = stack[-1]
            nxt = next((n for n in it if n not in seen), None)
            if nxt is None:
                order.append(node)
                stack.pop()
            else:
                seen.add(nxt)
                stack.append((nxt, iter(graph.get(nxt, ()))))
    back = reverse(graph)
    found: list[set[int]] = []
    assigned: set[int] = set()
    for node in reversed(order):
        if node in assigned:
            continue
        component, todo = {node}, [node]
        assigned.add(node)
        while todo:
            for n in back.get(todo.pop(), ()):
                if n not in assigned:
                    assigned.add(n)
                    component.add(n)
                    todo.append(n)
        found.append(component)
    return found
