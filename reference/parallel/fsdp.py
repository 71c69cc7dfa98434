"""Fully sharded data parallelism (ZeRO-3): parameters sharded per unit, gathered only while a unit computes."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def _tensors_in(value) -> list[torch.Tensor]:
    """The tensors in a module's output: itself, or those in its (nested) tuples, lists and dict values."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [tensor for item in value for tensor in _tensors_in(item)]
    return []


class _Unit:
    """One direct child of the wrapped module: its trainable parameters as one padded flat tensor, sharded."""

    def __init__(self, name: str, child: torch.nn.Module, group, compute_dtype: torch.dtype | None):
        self.name, self.group = name, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        # (owning submodule, attribute, name within the unit, shape) of each trainable parameter, in flat order.
        self.slots = []
        pieces = []
        for qualified, param in child.named_parameters():
            if not param.requires_grad:
                continue
            owner_path, _, attribute = qualified.rpartition(".")
            owner = child.get_submodule(owner_path)
            self.slots.append((owner, attribute, qualified, param.shape))
            pieces.append(param.detach().reshape(-1))
        self.numels = [piece.numel() for piece in pieces]
        self.padded = math.ceil(sum(self.numels) / self.world_size) * self.world_size
        shard_size = self.padded // self.world_size
        flat = torch.zeros(self.padded, dtype=torch.float32, device=pieces[0].device)
        torch.cat(pieces, out=flat[: sum(self.numels)])
        self.shard = torch.nn.Parameter(flat[self.rank * shard_size : (self.rank + 1) * shard_size].clone())
        for owner, attribute, _, _ in self.slots:
            delattr(owner, attribute)  # the full parameter is dropped: only the shard persists
        self.compute_dtype = compute_dtype or torch.float32
        self.gathered: torch.Tensor | None = None  # the flat parameter of the current step, storage freed between uses

        child.register_forward_pre_hook(self._before_forward)
        child.register_forward_hook(self._after_forward)

    # --- gathering and freeing ------------------------------------------------------------------------------------

    def all_gather_into(self, flat: torch.Tensor) -> None:
        # `.data` writes the values without bumping the version counter that autograd's saved views share with flat.
        dist.all_gather_into_tensor(flat.data, self.shard.detach().to(self.compute_dtype), group=self.group)

    def free(self) -> None:
        self.gathered.untyped_storage().resize_(0)

    def _regather(self, _grad=None) -> None:
        """Before the unit's backward (a hook on its outputs' gradients): refill the storage the saved views use."""
        storage = self.gathered.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.padded * self.gathered.element_size())
            self.all_gather_into(self.gathered)

    def _before_forward(self, child, args):
        self.gathered = _GatherShard.apply(self.shard, self)
        views = self.gathered[: sum(self.numels)].split(self.numels)
        for (owner, attribute, _, shape), view in zip(self.slots, views):
            setattr(owner, attribute, view.view(shape))
        return tuple(a.to(self.compute_dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    def _after_forward(self, child, args, output):
        self.free()
        for tensor in _tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(self._regather)

    def reduce_scatter_gradient(self, flat_grad: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the average over ranks of the unit's flat gradient, in float32."""
        shard_grad = torch.empty(self.padded // self.world_size, dtype=flat_grad.dtype, device=flat_grad.device)
        dist.reduce_scatter_tensor(shard_grad, flat_grad.contiguous(), op=dist.ReduceOp.SUM, group=self.group)
        # Sum then divide: gloo lacks ReduceOp.AVG on older torch.
        return shard_grad.div_(self.world_size).to(torch.float32)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        flat = torch.empty(self.padded, dtype=torch.float32, device=self.shard.device)
        dist.all_gather_into_tensor(flat, self.shard.detach(), group=self.group)
        views = flat[: sum(self.numels)].split(self.numels)
        return {f"{self.name}.{qualified}": view.view(shape).clone()
                for (_, _, qualified, shape), view in zip(self.slots, views)}


class _GatherShard(torch.autograd.Function):
    """shard -> the unit's gathered flat parameter; backward reduce-scatters the flat gradient back to the shard.

    Autograd calls backward once every view of the gathered tensor has delivered its gradient, that is once the
    unit's backward is complete, so this is where the gathered parameters are freed and the gradient leaves.
    """

    @staticmethod
    def forward(ctx, shard: torch.Tensor, unit: _Unit) -> torch.Tensor:
        ctx.unit = unit
        flat = torch.empty(unit.padded, dtype=unit.compute_dtype, device=shard.device)
        unit.all_gather_into(flat)
        return flat

    @staticmethod
    def backward(ctx, flat_grad: torch.Tensor):
        unit = ctx.unit
        unit.free()
        return unit.reduce_scatter_gradient(flat_grad), None


class FSDP(torch.nn.Module):
    """Each direct child of `module` holding trainable parameters is a unit whose flat parameter is sharded over the
    ranks of `group`; at most one unit is gathered at a time (two for a moment at unit boundaries in backward)."""

    def __init__(self, module: torch.nn.Module, compute_dtype: torch.dtype | None = None,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        check_shardable(module)
        self.module = module
        self.group = group
        self.units = [
            _Unit(name, child, group, compute_dtype)
            for name, child in module.named_children()
            if any(p.requires_grad for p in child.parameters())
        ]
        # Registered here so that fsdp.parameters() and .to() see the shards.
        self.shards = torch.nn.ParameterList([unit.shard for unit in self.units])

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def sharded_parameters(self) -> list[torch.nn.Parameter]:
        return [unit.shard for unit in self.units]

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        full = {}
        for unit in self.units:
            full.update(unit.full_parameters())
        for name, param in self.module.named_parameters():
            full[name] = param.detach().to(torch.float32).clone()  # frozen ones: the only ones still registered
        return full


def check_shardable(module: torch.nn.Module) -> None:
    """ValueError for a parameter outside every unit, or one Parameter under two names."""
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise ValueError(f"parameter {own[0]!r} belongs to the wrapped module itself, not to one of its children "
                         "(the units)")
    first_name = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            raise ValueError(f"parameters {first_name[id(param)]!r} and {name!r} are one tied Parameter: "
                             "tied weights are not supported")
        first_name[id(param)] = name
