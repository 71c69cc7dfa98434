"""A reference call's values to and from storage: tensors taken out of containers and put back, and the changes
a call makes to its arguments."""

from __future__ import annotations

import dataclasses
import importlib
from collections import namedtuple

import torch

from grader.expectations.digests import digest

NAMEDTUPLE_TAG = "\x00namedtuple"
DATACLASS_TAG = "\x00dataclass"  # the grader's own (e.g. attention_cases.Expected), rebuilt from its module


def flatten(value) -> tuple[list[torch.Tensor], object]:
    """The tensors in `value` (in a fixed order) and a template of `value` with each one replaced by its index."""
    tensors: list[torch.Tensor] = []

    def walk(item):
        if isinstance(item, torch.Tensor):
            tensors.append(item)
            return ("\x00tensor", len(tensors) - 1)
        if isinstance(item, tuple) and hasattr(item, "_fields"):
            return {NAMEDTUPLE_TAG: type(item).__name__, "fields": list(item._fields),
                    "values": [walk(v) for v in item]}
        if dataclasses.is_dataclass(item) and type(item).__module__.startswith("grader."):
            return {DATACLASS_TAG: f"{type(item).__module__}:{type(item).__qualname__}",
                    "values": {f.name: walk(getattr(item, f.name)) for f in dataclasses.fields(item)}}
        if isinstance(item, (tuple, list)):
            return type(item)(walk(v) for v in item)
        if isinstance(item, dict):
            return {key: walk(v) for key, v in item.items()}
        if item is None or isinstance(item, (bool, int, float, str, torch.dtype)):
            return item
        raise TypeError(f"cannot store a {type(item).__name__} returned by the reference; teach grader.expectations")

    return tensors, walk(value)


_NAMEDTUPLES: dict[tuple, type] = {}


def unflatten(template, tensors: list[torch.Tensor]):
    """The value that `flatten` took apart, with `tensors` in place; a named tuple comes back as a named tuple of the
    same name and fields (a plain one: the reference's class is not there)."""
    if isinstance(template, tuple) and len(template) == 2 and template[0] == "\x00tensor":
        return tensors[template[1]]
    if isinstance(template, dict) and DATACLASS_TAG in template:
        module, name = template[DATACLASS_TAG].split(":")
        if not module.startswith("grader."):
            raise ValueError(f"stored expectations name {module}: only the grader's own classes are rebuilt")
        cls = getattr(importlib.import_module(module), name)
        return cls(**{key: unflatten(v, tensors) for key, v in template["values"].items()})
    if isinstance(template, dict) and NAMEDTUPLE_TAG in template:
        key = (template[NAMEDTUPLE_TAG], tuple(template["fields"]))
        cls = _NAMEDTUPLES.setdefault(key, namedtuple(*key))
        return cls(*(unflatten(v, tensors) for v in template["values"]))
    if isinstance(template, (tuple, list)):
        return type(template)(unflatten(v, tensors) for v in template)
    if isinstance(template, dict):
        return {key: unflatten(v, tensors) for key, v in template.items()}
    return template


def stored(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().clone()


def leaves(value) -> list[torch.Tensor]:
    """The tensors a call may change as a side effect: its tensor arguments and its modules' parameters and buffers."""
    found: list[torch.Tensor] = []

    def walk(item):
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, torch.nn.Module):
            found.extend(item.parameters())
            found.extend(item.buffers())
        elif isinstance(item, (tuple, list)):
            for v in item:
                walk(v)
        elif isinstance(item, dict):
            for v in item.values():
                walk(v)

    walk(value)
    return found


def state_of(tensor: torch.Tensor) -> tuple[str, str | None]:
    return digest(tensor.detach()), None if tensor.grad is None else digest(tensor.grad)


def side_effects(tensors: list[torch.Tensor], before: list[tuple]) -> dict[int, dict]:
    """What a call changed in its arguments: new values and new gradients, by leaf index."""
    effects = {}
    for index, (tensor, (data, grad)) in enumerate(zip(tensors, before)):
        now_data, now_grad = state_of(tensor)
        change = {}
        if now_data != data:
            change["data"] = stored(tensor)
        if now_grad != grad:
            change["grad"] = None if tensor.grad is None else stored(tensor.grad)
        if change:
            effects[index] = change
    return effects


def apply_side_effects(tensors: list[torch.Tensor], effects: dict[int, dict]) -> None:
    with torch.no_grad():
        for index, change in effects.items():
            tensor = tensors[index]
            if "data" in change:
                tensor.copy_(change["data"].to(tensor.device))
            if "grad" in change:
                tensor.grad = None if change["grad"] is None else change["grad"].to(tensor.device).clone()


def substitute(value, replacements: dict[int, torch.Tensor]):
    """`value` with each tensor whose id is a key replaced by its value (containers rebuilt, named tuples kept)."""
    if isinstance(value, torch.Tensor):
        return replacements.get(id(value), value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(substitute(v, replacements) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(substitute(v, replacements) for v in value)
    if isinstance(value, dict):
        return {key: substitute(v, replacements) for key, v in value.items()}
    return value


def differentiable_inputs(args, kwargs) -> list[torch.Tensor]:
    """The tensor arguments (not module parameters) that gradients can flow back to, each once."""
    if not torch.is_grad_enabled():
        return []
    seen: dict[int, torch.Tensor] = {}
    for tensor in plain_tensors((args, kwargs)):
        if tensor.requires_grad:
            seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def plain_tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in plain_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in plain_tensors(v)]
    return []
