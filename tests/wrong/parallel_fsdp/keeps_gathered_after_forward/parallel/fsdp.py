"""FSDP: each child module is a unit whose trainable parameters are flattened, padded and sharded over the ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist


class Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, unit):
        ctx.unit = unit
        full = torch.empty(unit.padded, dtype=unit.dtype, device=shard.device)
        dist.all_gather_into_tensor(full, shard.detach().to(unit.dtype), group=unit.group)
        return full

    @staticmethod
    def backward(ctx, grad):
        unit = ctx.unit
        unit.full.untyped_storage().resize_(0)
        out = torch.empty(unit.padded // unit.ws, dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=unit.group)
        out /= unit.ws
        return out.float(), None


class Unit:
    def __init__(self, name, child, group, dtype):
        self.name, self.group, self.dtype = name, group, dtype or torch.float32
        self.rank, self.ws = dist.get_rank(group), dist.get_world_size(group)
        self.entries = []
        for pname, p in child.named_parameters():
            if p.requires_grad:
                owner, _, attr = pname.rpartition(".")
                self.entries.append((child.get_submodule(owner), attr, pname, p.shape, p.numel()))
        flat = torch.cat([getattr(m, a).detach().reshape(-1) for m, a, _, _, _ in self.entries])
        self.numel = flat.numel()
        self.padded = -(-self.numel // self.ws) * self.ws
        flat = torch.cat([flat, flat.new_zeros(self.padded - self.numel)])
        size = self.padded // self.ws
        self.shard = torch.nn.Parameter(flat[self.rank * size:(self.rank + 1) * size].clone())
        for m, a, _, _, _ in self.entries:
            del m._parameters[a]
        self.full = None
        child.register_forward_pre_hook(self.pre_forward)
        child.register_forward_hook(self.post_forward)

    def set_views(self):
        views = self.full[:self.numel].split([e[4] for e in self.entries])
        for (m, a, _, shape, _), v in zip(self.entries, views):
            setattr(m, a, v.view(shape))

    def pre_forward(self, module, args):
        self.full = Gather.apply(self.shard, self)
        self.set_views()
        return tuple(x.to(self.dtype) if torch.is_tensor(x) and x.is_floating_point() else x for x in args)

    def post_forward(self, module, args, output):
        outputs = output if isinstance(output, (tuple, list)) else [output]
        for t in outputs:
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(self.pre_backward)

    def pre_backward(self, grad):
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.padded * self.full.element_size())
        dist.all_gather_into_tensor(self.full.data, self.shard.detach().to(self.dtype), group=self.group)


class FSDP(torch.nn.Module):
    def __init__(self, module, compute_dtype=None, group=None):
        super().__init__()
        if list(module.parameters(recurse=False)):
            raise ValueError("parameters directly on the wrapped module are not supported")
        seen = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                raise ValueError(f"{name} is tied to {seen[id(p)]}")
            seen[id(p)] = name
        self.module = module
        self.group = group
        self.units = [Unit(n, c, group, compute_dtype) for n, c in module.named_children()
                      if any(p.requires_grad for p in c.parameters())]
        self.shards = torch.nn.ParameterList([u.shard for u in self.units])

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def sharded_parameters(self):
        return [u.shard for u in self.units]

    @torch.no_grad()
    def full_state_dict(self):
        result = {}
        for u in self.units:
            flat = torch.empty(u.padded, device=u.shard.device)
            dist.all_gather_into_tensor(flat, u.shard.detach(), group=self.group)
            pieces = flat[:u.numel].split([e[4] for e in u.entries])
            for (_, _, pname, shape, _), piece in zip(u.entries, pieces):
                result[f"{u.name}.{pname}"] = piece.view(shape).clone()
        for name, p in self.module.named_parameters():
            result[name] = p.detach().clone()
        return result
