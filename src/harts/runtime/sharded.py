"""FSDP2 units gathered layer by layer inside harts' step, as FSDP2 itself gathers them.

harts runs a model's parts itself, so FSDP2's forward hooks never fire. Under
:class:`ShardedStep` the step does their work, unit by unit:

- **Outer units** (the model and its backbone: embeddings, final norm, head) are gathered once
  for the whole step, as FSDP2 keeps its root gathered from forward to the end of backward.
- **Decoder-layer units** are gathered right before a part's forward runs the layer and resharded
  right after (:meth:`ShardedStep.layer`). The layer's input is cut from the graph (a leaf), so a
  part's backward runs layer by layer (:meth:`ShardedStep.backward`): the unit is gathered again,
  the layer's graph runs backward from its output and its exports (what later parts read), and
  its gradient is summed over the ranks and this rank's shard is added to the sharded
  parameter's ``.grad`` (a DTensor) before the unit is resharded. Saved activations that are the
  parameters themselves share the unsharded storage that the gather refills, as under FSDP2.
- The outer units' gradients are summed once, when the step ends; then they are resharded.
- A forward-only pass (``forward_only=True``: old, reference and critic values, eval) runs the
  same gathers in the same lock step and sums nothing.

Every gather and sum is a collective, so every rank must issue the same sequence of them, while
ranks hold different trees and run different numbers of forwards and backwards. Before each
part's forward or backward the ranks agree in lock step (:class:`_Lockstep`: one all-reduce of
one integer, what each rank runs next); a rank whose next operation is not the one chosen runs
a stand-in of it (gathers, sums of zeros) and keeps its own for a later round. A statistic of
the whole step that a backward needs (the MoE routing fractions of the load-balancing loss) is
one more such operation (:meth:`ShardedStep.agree_sum`), run once every rank's first forwards
are done. Gradients are
summed, not averaged (harts' losses divide by normalisers of the whole step over all ranks); a
parameter no rank used keeps ``.grad`` None, as on one process.

The sum is a reduce-scatter of one unit's gradients at a time (one unit's worth of memory; each
rank receives only its rows, as FSDP2 sums them).

**Overlap** (``RunConfig.fsdp_overlap``, on by default): before a layer computes, the gather of
the layer that runs next in the same pass (the following layer in forward, the preceding one in
backward) is started asynchronously (``unshard(async_op=True)``) and waited for when that layer
starts, as FSDP2's own forward and backward prefetch do. The transfer then overlaps the layer's
compute, and two layer units are whole at a time instead of one. A pass never prefetches across
its end, so the order of collectives is the same on every rank (stand-ins run the same passes).
Likewise each layer unit's gradient sum (reduce-scatter) is started when its backward ends and
waited for when the next layer's backward has run, so the sum overlaps that compute; the unit is
resharded while its sum runs (the sum reads a copy of the gradients).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ShardedStep", "PartSegments", "LayerSegment"]

Tensor = torch.Tensor
# lock-step codes: the largest any rank wants runs first (forwards, then statistics, then backwards)
_FORWARD, _AGREE, _BACKWARD, _DONE = 3, 2, 1, 0


@dataclass
class LayerSegment:
    """One layer's piece of a part's graph: its input leaf and its output."""

    index: int
    leaf: Tensor
    output: Tensor


@dataclass
class PartSegments:
    """A part's graph cut at every layer: the embedding output, one segment per layer, the input
    leaf of the final norm (where the rows' graph starts)."""

    embedded: Tensor | None = None
    layers: list[LayerSegment] = field(default_factory=list)
    top: Tensor | None = None


class _Unit:
    """One FSDP2 unit: the module, its trainable sharded parameters by name."""

    def __init__(self, module: nn.Module, names: list[str], params: list[nn.Parameter]):
        self.module = module
        self.names = names
        self.sharded = params
        self.grad_before = [p.grad is not None for p in params]
        self.used = torch.zeros(len(params))

    def unsharded(self) -> list[Tensor]:
        """The unsharded parameters (the module must be unsharded), in ``names`` order."""
        current = dict(self.module.named_parameters())
        return [current[n] for n in self.names]


class _Lockstep:
    """Ranks agree on the kind of each operation: forward (gathers), agreement on statistics (one
    sum), backward (gathers and sums)."""

    def __init__(self, group, stand_in: Callable[[int], None]):
        self.group = group
        self.device = _collective_device(group)
        self.stand_in = stand_in

    def _round(self, mine: int) -> int:
        """The operation of this round: the largest code any rank wants (forward before backward
        before done), so every round some rank runs its own and the step ends."""
        code = torch.tensor([mine], dtype=torch.int64, device=self.device)
        dist.all_reduce(code, op=dist.ReduceOp.MAX, group=self.group)
        return int(code)

    def enter(self, kind: int) -> None:
        """Return when every rank runs an operation of ``kind`` now (or a stand-in of it)."""
        while (chosen := self._round(kind)) != kind:
            self.stand_in(chosen)

    def finish(self) -> None:
        """Stand in for the others' operations until every rank is done."""
        while (chosen := self._round(_DONE)) != _DONE:
            self.stand_in(chosen)


class ShardedStep:
    """One step of an FSDP2 model with its units gathered layer by layer (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        layers: list[nn.Module],
        fsdp_modules: list[nn.Module],
        group=None,
        overlap: bool = True,
        forward_only: bool = False,
    ):
        self.forward_only = forward_only  # no backward on any rank: no gradient sum at the end
        layer_ids = {id(m) for m in layers}
        self.group = group
        self.layers: list[_Unit | None] = []
        in_layers: set[int] = set()
        for layer in layers:
            if id(layer) in {id(m) for m in fsdp_modules}:
                named = [(n, p) for n, p in layer.named_parameters() if p.requires_grad]
                self.layers.append(_Unit(layer, [n for n, _ in named], [p for _, p in named]))
                in_layers.update(id(p) for _, p in named)
            else:
                self.layers.append(None)  # not a unit of its own: its parameters are the outer units'
        self.outer_modules = [m for m in fsdp_modules if id(m) not in layer_ids]
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in in_layers]
        self.model = model
        self.outer = _Unit(model, [n for n, _ in named], [p for _, p in named])
        self.lockstep = _Lockstep(group, self._stand_in)
        self._agreement: tuple[int, torch.dtype] | None = None
        self.overlap = overlap
        self._pending: dict[int, object] = {}  # layer index -> the handle of its started gather

    # ---- the step's frame ---------------------------------------------------------------------
    def begin(self) -> None:
        for m in self.outer_modules:
            m.unshard()

    def end(self) -> None:
        """After every part: wait for the other ranks, sum the outer units' gradients, reshard them,
        and leave ``.grad`` None where no rank produced a gradient."""
        self.lockstep.finish()
        self._drop_pending()
        if self.forward_only:  # every rank: the same code path, so the same (absent) collectives
            for m in self.outer_modules:
                m.reshard()
            return
        self._reduce(self.outer)
        for m in self.outer_modules:
            m.reshard()
        units = [u for u in self.layers if u is not None] + [self.outer]
        used = torch.cat([u.used for u in units]).to(self.lockstep.device)
        dist.all_reduce(used, group=self.group)
        used = used.cpu()
        offset = 0
        for u in units:
            for p, before, count in zip(
                u.sharded, u.grad_before, used[offset : offset + len(u.sharded)], strict=True
            ):
                if count == 0 and not before:
                    p.grad = None
            offset += len(u.sharded)

    def abort(self) -> None:
        """Reshard everything after an error (the other ranks fail on their next collective)."""
        self._pending.clear()
        for unit in self.layers:
            if unit is not None:
                unit.module.reshard()
        for m in self.outer_modules:
            m.reshard()

    # ---- statistics of the whole step ----------------------------------------------------------
    def expect_agreement(self, numel: int, dtype: torch.dtype) -> None:
        """Every rank's step will sum one tensor of ``numel`` elements over the ranks once
        (:meth:`agree_sum`), after its first forwards and before its first backward: a rank that
        stands in for it sums zeros of that size."""
        self._agreement = (numel, dtype)

    def agree_sum(self, t: Tensor) -> Tensor:
        """``t`` (flat, the size given to :meth:`expect_agreement`) summed over the ranks, in lock
        step: it runs once no rank has a forward left before its own agreement."""
        if self._agreement is None or t.numel() != self._agreement[0]:
            raise RuntimeError(f"agree_sum of {t.numel()} elements; expected {self._agreement}")
        self.lockstep.enter(_AGREE)
        on_device = t.to(self.lockstep.device)
        dist.all_reduce(on_device, group=self.group)
        return t.copy_(on_device)

    # ---- forward -----------------------------------------------------------------------------------
    def enter_forward(self) -> None:
        self.lockstep.enter(_FORWARD)

    def enter_backward(self) -> None:
        self.lockstep.enter(_BACKWARD)

    def embedded(self, hidden: Tensor, segments: PartSegments | None) -> Tensor:
        if segments is None:
            return hidden
        segments.embedded = hidden
        return hidden.detach().requires_grad_()

    def layer(
        self,
        index: int,
        fn: Callable[[Tensor], Tensor] | None,
        hidden: Tensor | None,
        segments: PartSegments | None,
    ) -> Tensor | None:
        """Layer ``index`` of a part's forward with its unit gathered; with ``segments`` (autograd),
        its input becomes a leaf and the segment is recorded. ``fn`` None: another rank's forward,
        the same gathers and nothing computed."""
        unit = self._gather(index, index + 1)
        try:
            out = fn(hidden) if fn is not None else None
        finally:
            if unit is not None:
                unit.module.reshard()
        if segments is None:
            return out
        segments.layers.append(LayerSegment(index, hidden, out))
        return out.detach().requires_grad_()

    def top(self, hidden: Tensor, segments: PartSegments | None) -> Tensor:
        if segments is not None:
            segments.top = hidden
        return hidden

    # ---- backward ------------------------------------------------------------------------------
    def backward(
        self,
        segments: PartSegments | None,
        top_roots: list[tuple[Tensor, Tensor]],
        layer_roots: dict[int, list[tuple[Tensor, Tensor]]],
    ) -> None:
        """A part's backward, layer by layer: ``top_roots`` (row outputs and their gradients) into
        the final norm's input, then each layer, last first, from its output (the gradient its
        successor sent) and ``layer_roots[index]`` (its exports' gradients from later parts), the
        unit gathered and its gradient summed.
        ``segments`` None: another rank's backward, the same collectives and nothing computed."""
        _backward(top_roots)
        grad = segments.top.grad if segments is not None and segments.top is not None else None
        by_index = {s.index: s for s in segments.layers} if segments is not None else {}
        summing: Callable[[], None] | None = None  # the previous layer's gradient sum, in flight
        for index in reversed(range(len(self.layers))):
            segment = by_index.get(index)
            roots = list(layer_roots.get(index, []))
            if segment is not None and grad is not None:
                roots.append((segment.output, grad))
            unit = self._gather(index, index - 1)
            try:
                _backward(roots)
                if summing is not None:  # overlapped this layer's backward; an error drops it
                    summing()
                    summing = None
                if unit is not None:
                    summing = self._start_reduce(unit) if self.overlap else self._reduce(unit)
            finally:
                if unit is not None:
                    unit.module.reshard()
            grad = segment.leaf.grad if segment is not None else None
        if summing is not None:
            summing()
        if segments is not None and segments.embedded is not None and grad is not None:
            _backward([(segments.embedded, grad)])

    def _gather(self, index: int, following: int) -> _Unit | None:
        """Layer ``index``'s unit, gathered (waiting for its prefetch when one was started), and,
        with prefetching, the gather of the layer that runs next in this pass (``following``)
        started before this one computes: every rank runs the same passes (stand-ins included), so
        the collectives stay in the same order on every rank."""
        unit = self.layers[index]
        if unit is not None:
            handle = self._pending.pop(index, None)
            if handle is not None:
                handle.wait()
            else:
                unit.module.unshard()
        if self.overlap and 0 <= following < len(self.layers) and self.layers[following] is not None:
            self._pending[following] = self.layers[following].module.unshard(async_op=True)
        return unit

    def _drop_pending(self) -> None:
        """A prefetched gather no pass used (a pass that stopped before its last layer): wait for
        it and reshard, so no unit stays whole past the step."""
        for index, handle in sorted(self._pending.items()):
            handle.wait()
            self.layers[index].module.reshard()
        self._pending.clear()

    # ---- stand-ins and sums --------------------------------------------------------------------
    def _stand_in(self, kind: int) -> None:
        """Another rank's forward or backward, through the same code: the same gathers and sums (of
        zeros) in the same order, nothing computed."""
        if kind == _FORWARD:
            for index in range(len(self.layers)):
                self.layer(index, None, None, None)
        elif kind == _BACKWARD:
            self.backward(None, [], {})
        elif kind == _AGREE:
            if self._agreement is None:
                raise RuntimeError("another rank sums step statistics that this rank does not expect")
            numel, dtype = self._agreement
            zeros = torch.zeros(numel, dtype=dtype, device=self.lockstep.device)
            dist.all_reduce(zeros, group=self.group)

    def _reduce(self, unit: _Unit) -> None:
        self._start_reduce(unit)()

    def _start_reduce(self, unit: _Unit) -> Callable[[], None]:
        """Start summing the unit's unsharded gradients over the ranks (zeros where this rank has
        none); the returned ``finish()`` waits and adds this rank's shard to each sharded
        parameter's ``.grad``. The unsharded gradients are freed at once (the sums read copies), so
        the unit can be resharded while the sums run.

        Sharded parameters go through one reduce-scatter per dtype (each rank receives only its
        rows, laid out as FSDP2 pads them: every rank's chunk of every parameter padded to the
        largest chunk); a parameter ``fully_shard`` left replicated is all-reduced whole."""
        from torch.distributed.tensor import DTensor

        full = unit.unsharded()
        for i, p in enumerate(full):
            if p.grad is not None:
                unit.used[i] += 1
        groups: dict[tuple[bool, torch.dtype], list[int]] = {}
        for i, s in enumerate(unit.sharded):
            groups.setdefault((isinstance(s, DTensor), _local(s).dtype), []).append(i)
        started = []
        for (sharded, dtype), index in groups.items():
            grads = [_grad_or_zeros(full[i]).to(dtype) for i in index]
            if sharded:
                started.append((index, True, _start_reduce_scatter(grads, [unit.sharded[i] for i in index])))
            else:
                flat = torch.cat([g.reshape(-1) for g in grads])
                work = dist.all_reduce(flat, group=self.group, async_op=True)
                shapes = [g.shape for g in grads]

                def pieces(flat=flat, work=work, shapes=shapes):
                    work.wait()
                    sizes = [int(torch.Size(s).numel()) for s in shapes]
                    return [p.view(s).clone() for p, s in zip(flat.split(sizes), shapes, strict=True)]

                started.append((index, False, pieces))
        for p in full:
            p.grad = None

        def finish() -> None:
            for index, sharded, pieces in started:
                for i, local in zip(index, pieces(), strict=True):
                    s = unit.sharded[i]
                    if sharded:
                        # the shard's own device: the CPU under FSDP2's CPUOffloadPolicy
                        new = DTensor.from_local(
                            local.to(_local(s).device).contiguous(),
                            s.device_mesh,
                            s.placements,
                            shape=s.shape,
                            stride=s.stride(),
                        )
                    else:
                        new = local
                    s.grad = new if s.grad is None else s.grad + new

        return finish


def _start_reduce_scatter(grads: list[Tensor], sharded: list) -> Callable[[], list[Tensor]]:
    """Start summing each whole gradient over the mesh's ranks; the returned function waits and
    gives this rank's shard of each. One ``reduce_scatter_tensor`` over a buffer holding, rank
    after rank, every parameter's chunk (``torch.chunk`` along its shard dimension, as FSDP2 splits
    it) padded to the largest chunk."""
    mesh = sharded[0].device_mesh
    group, world, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    dims = [_shard_dim(s) for s in sharded]
    per_rank: list[list[Tensor]] = [[] for _ in range(world)]
    padded_shapes = []
    for g, dim in zip(grads, dims, strict=True):
        rows = -(-g.shape[dim] // world) if g.shape[dim] else 0
        chunks = torch.chunk(g, world, dim=dim) if g.shape[dim] else ()
        shape = list(g.shape)
        shape[dim] = rows
        padded_shapes.append(shape)
        for r in range(world):
            piece = chunks[r] if r < len(chunks) else g.narrow(dim, 0, 0)
            if piece.shape[dim] < rows:
                pad = list(g.shape)
                pad[dim] = rows - piece.shape[dim]
                piece = torch.cat([piece, g.new_zeros(pad)], dim=dim)
            per_rank[r].append(piece.reshape(-1))
    send = torch.cat([torch.cat(pieces) if pieces else grads[0].new_zeros(0) for pieces in per_rank])
    mine = send.new_empty(send.numel() // world)
    work = dist.reduce_scatter_tensor(mine, send, group=group, async_op=True)

    def shards(send=send) -> list[Tensor]:  # ``send`` lives until the sum is done
        work.wait()
        del send
        out = []
        sizes = [int(torch.Size(s).numel()) for s in padded_shapes]
        for piece, shape, dim, s in zip(mine.split(sizes), padded_shapes, dims, sharded, strict=True):
            local_rows = s.to_local().shape[dim]
            local = piece.view(shape).narrow(dim, 0, local_rows)
            if tuple(local.shape) != tuple(s.to_local().shape):
                raise ValueError(
                    f"unexpected FSDP2 shard shape {tuple(s.to_local().shape)} on rank {rank} "
                    f"for a parameter of shape {tuple(s.shape)} (expected {tuple(local.shape)})"
                )
            out.append(local.clone())
        return out

    return shards


def _grad_or_zeros(p: Tensor) -> Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _shard_dim(sharded) -> int:
    from torch.distributed.tensor import Shard

    placement = sharded.placements[0]
    if len(sharded.placements) != 1 or not isinstance(placement, Shard):
        raise ValueError(
            f"harts handles FSDP2 parameters sharded on one mesh dimension, got {sharded.placements}"
        )
    return placement.dim


def _collective_device(group) -> torch.device:
    """Where small control tensors go for a collective: NCCL reduces CUDA tensors only."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _backward(pairs: list[tuple[Tensor, Tensor]]) -> None:
    live = [(t, g) for t, g in pairs if t is not None and g is not None and t.requires_grad]
    if live:
        torch.autograd.backward([t for t, _ in live], [g.to(t.dtype) for t, g in live])


def _local(t: Tensor) -> Tensor:
    return t.to_local() if type(t).__name__ == "DTensor" else t
