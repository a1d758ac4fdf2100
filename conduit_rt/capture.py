"""What a request's prefill passes keep of each decoder layer (``PassCapture``): q and the attention's
log-sum-exp of the positions scoring and compression read, and the pre-RoPE K and V of the images
the request stores."""
from __future__ import annotations

import torch


class PassCapture:
    """LayerCapture of a request's passes: q and the attention's log-sum-exp of the observed positions
    per layer (the latest pass that computed a position wins), and pre-RoPE K and V of the image
    tokens to store.

    Per layer, each pass's observed q rows stay one tensor ([n_observed, n_heads, head_dim]) beside
    the pass's position -> row map, which is built once per chunk and shared by its layers: a layer
    costs one gather (a copy when the rows are consecutive, as a text pass's trailing question is),
    no per-position work and no host sync (the row index is uploaded once per chunk, without
    blocking). Their lse rows ([n_observed, n_heads] float32) are a view of the attention's own
    output when consecutive (no launch), else one gather.
    """

    def __init__(self, observe: set[int], store: dict[bytes, tuple[int, int]]) -> None:
        self.observe, self.store = observe, store
        self.q: dict[int, list[tuple[dict[int, int], torch.Tensor]]] = {}  # layer -> [(position -> row, q rows)]
        self.lse: dict[int, list[torch.Tensor]] = {}  # layer -> lse rows, one per entry of self.q[layer]
        self._kv: dict[bytes, dict[int, tuple[list, list]]] = {key: {} for key in store}
        self._positions: list[int] = []
        self._observed: dict[int, int] = {}  # position -> row among the chunk's observed rows
        self._rows = _DeviceIndex([])        # the chunk's observed rows, in order
        self._plans: dict[tuple, tuple[list[int], object, tuple]] = {}  # see _query_plan

    def begin_chunk(self, positions: list[int]) -> None:
        """The next forward computes these prompt positions, one per row."""
        self._positions = positions
        self._rows = _DeviceIndex([i for i, p in enumerate(positions) if p in self.observe])
        self._observed = {positions[i]: j for j, i in enumerate(self._rows.rows)}

    def on_layer(self, layer: int, q: torch.Tensor, k_pre_rope: torch.Tensor, v: torch.Tensor) -> None:
        if self._rows.rows:
            # copied: q may be a buffer the next layer overwrites
            self.q.setdefault(layer, []).append((self._observed, self._observed_rows(q, copy=True)))
        lo, hi = self._positions[0], self._positions[-1] + 1
        for key, (a, b) in self.store.items():
            rows = [i for i, p in enumerate(self._positions) if a <= p < b] if a < hi and b > lo else []
            if rows:
                idx = torch.tensor(rows).to(k_pre_rope.device, non_blocking=True)
                ks, vs = self._kv[key].setdefault(layer, ([], []))
                ks.append(k_pre_rope[idx].clone())
                vs.append(v[idx].clone())

    def on_attention(self, layer: int, lse: torch.Tensor) -> None:
        if self._rows.rows:
            self.lse.setdefault(layer, []).append(self._observed_rows(lse, copy=False))

    def _observed_rows(self, t: torch.Tensor, copy: bool) -> torch.Tensor:
        """The chunk's observed rows of t: a slice (copied if ``copy``) when consecutive, else a gather."""
        rows = self._rows.rows
        if rows[-1] - rows[0] + 1 == len(rows):
            view = t[rows[0]: rows[0] + len(rows)]
            return view.clone() if copy else view
        return t[self._rows.on(t.device)]

    def queries(self, layer: int, positions: list[int]) -> tuple[torch.Tensor, list[int]]:
        """q at ``layer`` of those ``positions`` that were computed: ([n, n_heads, head_dim], positions)."""
        q, found = self._rows_of(self.q.get(layer, []), positions)
        return (q.contiguous(), found) if found else (torch.zeros(0), [])

    def scoring_rows(self, layers: list[int], positions: list[int]
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None, list[int]]:
        """q and the attention's lse of those ``positions`` that were computed, every layer of ``layers``
        stacked: ([n_layers, n, n_heads, head_dim], float32 [n_layers, n, n_heads], positions); the
        positions must be the same in every layer (a pass computes all of them). Tensors are None when
        none was computed."""
        qs, lses, found = [], [], None
        for layer in layers:
            passes = self.q.get(layer, [])
            lses_of_layer = self.lse.get(layer, [])
            if len(lses_of_layer) != len(passes):
                raise RuntimeError(f"layer {layer}: a pass kept q without its attention's lse")
            q, layer_found = self._rows_of(passes, positions)
            lse, _ = self._rows_of([(rows, lse) for (rows, _), lse in zip(passes, lses_of_layer)], positions)
            if found is not None and layer_found != found:
                raise RuntimeError(f"layer {layer} computed other query positions than layer {layers[0]}")
            found = layer_found
            qs.append(q)
            lses.append(lse)
        if not found:
            return None, None, []
        return torch.stack(qs), torch.stack(lses), found

    def _rows_of(self, passes: list[tuple[dict[int, int], torch.Tensor]], positions: list[int]
                 ) -> tuple[torch.Tensor | None, list[int]]:
        """The rows of the passes' tensors holding those ``positions`` that were computed (the latest
        pass wins), in the order of ``positions``: (tensor or None, the positions found)."""
        found, gather = self._query_plan(tuple(rows for rows, _ in passes), positions)
        found = list(found)  # the plan's own is shared by every layer
        if not found:
            return None, []
        if isinstance(gather, int):  # one pass computed them all, as its rows in order
            return passes[gather][1], found
        if isinstance(gather, tuple):  # one pass, some of its rows: one gather
            index, rows = gather
            tensor = passes[index][1]
            return tensor[rows.on(tensor.device)], found
        return torch.stack([passes[index][1][row] for index, row in gather]), found

    def _query_plan(self, maps: tuple[dict[int, int], ...], positions: list[int]) -> tuple[list[int], object]:
        """Which of ``positions`` the passes computed and where their q rows lie, worked out once per
        distinct list of position -> row maps (every layer of a pass shares its chunk's map, so the
        32 layers of a scoring loop share one plan). The plan: a pass index (all its rows, in order),
        (pass index, its rows as a ``_DeviceIndex``) or [(pass index, row), ...] across passes."""
        key = (tuple(id(m) for m in maps), tuple(positions))
        plan = self._plans.get(key)
        if plan is not None and all(a is b for a, b in zip(plan[2], maps)):  # the same maps, not reused ids
            return plan[0], plan[1]
        sources = {}  # position -> (pass, row), the latest pass that computed it
        for index, rows in enumerate(maps):
            sources.update((p, (index, row)) for p, row in rows.items())
        found = [p for p in positions if p in sources]
        taken = [sources[p] for p in found]
        gather: object = taken
        if taken and all(index == taken[0][0] for index, _ in taken):
            index, rows = taken[0][0], [row for _, row in taken]
            gather = index if rows == list(range(len(maps[index]))) else (index, _DeviceIndex(rows))
        self._plans[key] = (found, gather, maps)
        return found, gather

    def stored(self, key: bytes, n_layers: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer pre-RoPE K and V [n_tokens, n_kv_heads, head_dim] of an image to store."""
        ks = [torch.cat(self._kv[key][layer][0]) for layer in range(n_layers)]
        vs = [torch.cat(self._kv[key][layer][1]) for layer in range(n_layers)]
        return ks, vs


class _DeviceIndex:
    """Row indices (a list, host) with their int64 tensor uploaded once per device, non-blocking (a
    blocking upload waits for every queued kernel)."""

    def __init__(self, rows: list[int]) -> None:
        self.rows = rows
        self._on: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        if device not in self._on:
            self._on[device] = torch.tensor(self.rows).to(device, non_blocking=True)
        return self._on[device]
