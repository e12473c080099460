"""Parameter trees: `attrs.frozen(eq=False)` classes registered as torch pytrees.

Every learnable or runtime-state tree in astrai (model params, KV caches, attention metadata) is a frozen
attrs class decorated with `@pytree`. Registered classes flatten to their tensor fields, so they can be
passed to `torch.compile(fullgraph=True)` steps and to `torch.func.grad` (DESIGN facts F1-F3).

Notable rules:
- Unflatten skips `__init__` and validators (`object.__new__` + `object.__setattr__`), because Dynamo cannot
  run attrs' generated frozen `__init__` (fact F2). Use `replace` instead of `attrs.evolve` for the same reason.
- Fields marked with `static()` are tree *context* (hashable Python data), not leaves; so are None fields.
- Key paths are checkpoint names: `.blocks[3].attn.q_proj.weight` <-> `blocks.3.attn.q_proj.weight`.

This is the only module that imports `torch.utils._pytree`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import attrs
import torch
import torch.utils._pytree as _pt

T = TypeVar("T")


def static(**kwargs: Any) -> Any:
    """An attrs field that is tree context (hashable, not a leaf): e.g. a page size needed to read leaves."""
    metadata = dict(kwargs.pop("metadata", {}) or {})
    metadata["static"] = True
    return attrs.field(metadata=metadata, **kwargs)


def _new(cls: type, names: list[str], values: list[Any]) -> Any:
    obj = object.__new__(cls)
    for name, value in zip(names, values, strict=True):
        object.__setattr__(obj, name, value)
    return obj


def pytree(cls: type[T]) -> type[T]:
    """Register an `attrs.frozen(eq=False)` class as a torch pytree node (children = non-static fields)."""
    if not attrs.has(cls):
        raise TypeError(f"@pytree expects an attrs class, got {cls.__qualname__}")
    fields = attrs.fields(cls)
    dyn = [f.name for f in fields if not f.metadata.get("static")]
    sta = [f.name for f in fields if f.metadata.get("static")]

    # None-valued fields are structure, not leaves (as in JAX): the context records which fields are present,
    # so torch.func transforms never see a None leaf.
    def flatten(x: Any) -> tuple[list[Any], tuple[Any, ...]]:
        present = tuple(n for n in dyn if getattr(x, n) is not None)
        return [getattr(x, n) for n in present], (present, tuple(getattr(x, n) for n in sta))

    def unflatten(children: Any, ctx: tuple[Any, ...]) -> Any:
        present, static_values = ctx
        values = dict(zip(present, children, strict=True))
        return _new(cls, dyn + sta, [*(values.get(n) for n in dyn), *static_values])

    def flatten_with_keys(x: Any) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
        children, ctx = flatten(x)
        return [(_pt.GetAttrKey(n), c) for n, c in zip(ctx[0], children, strict=True)], ctx

    _pt.register_pytree_node(
        cls,
        flatten,
        unflatten,
        flatten_with_keys_fn=flatten_with_keys,
        serialized_type_name=f"astrai.{cls.__module__}.{cls.__qualname__}",
    )
    return cls


def replace(obj: T, **changes: Any) -> T:
    """A copy of `obj` with some fields changed; safe inside compiled code (does not call `__init__`)."""
    names = [f.name for f in attrs.fields(type(obj))]
    unknown = set(changes) - set(names)
    if unknown:
        raise TypeError(f"{type(obj).__qualname__} has no field(s) {sorted(unknown)}")
    return _new(type(obj), names, [changes.get(n, getattr(obj, n)) for n in names])


def tree_map(fn: Callable[..., Any], tree: T, *rest: Any) -> T:
    """Apply `fn` to every leaf (None fields of astrai trees are structure and stay None)."""
    return _pt.tree_map(fn, tree, *rest)


def leaves(tree: Any) -> list[Any]:
    """The leaves of `tree` in flatten order."""
    return _pt.tree_leaves(tree)


def same_structure(a: Any, b: Any) -> bool:
    """Whether two trees have one structure: node types, present (non-None) fields, static values, leaf count."""
    return _pt.tree_structure(a) == _pt.tree_structure(b)


def _path_name(path: tuple[Any, ...]) -> str:
    parts = []
    for key in path:
        if isinstance(key, _pt.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, _pt.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, _pt.MappingKey):
            parts.append(str(key.key))
        else:
            raise TypeError(f"unsupported pytree key {key!r}")
    return ".".join(parts)


def named_leaves(tree: Any) -> Iterator[tuple[str, Any]]:
    """Yield `(name, leaf)` with dotted names (`blocks.3.attn.q_proj.weight`)."""
    for path, leaf in _pt.tree_leaves_with_path(tree):
        yield _path_name(path), leaf


def named_tensors(tree: Any) -> dict[str, torch.Tensor]:
    """`{name: tensor}` over the tensor leaves of `tree` (the checkpoint view of a param tree)."""
    return {name: leaf for name, leaf in named_leaves(tree) if isinstance(leaf, torch.Tensor)}


def from_named_tensors(template: T, tensors: dict[str, torch.Tensor]) -> T:
    """Rebuild `template`'s structure with leaves taken by name from `tensors` (all names must be present)."""
    flat, spec = _pt.tree_flatten_with_path(template)
    out = []
    for path, leaf in flat:
        name = _path_name(path)
        if isinstance(leaf, torch.Tensor):
            if name not in tensors:
                raise KeyError(f"missing tensor {name!r}")
            out.append(tensors[name])
        else:
            out.append(leaf)
    return _pt.tree_unflatten(out, spec)


def count(tree: Any) -> int:
    """Total number of elements over all tensor leaves."""
    return sum(x.numel() for x in leaves(tree) if isinstance(x, torch.Tensor))


def nbytes(tree: Any) -> int:
    """Total bytes over all tensor leaves."""
    return sum(x.numel() * x.element_size() for x in leaves(tree) if isinstance(x, torch.Tensor))


def cast(tree: T, dtype: torch.dtype) -> T:
    """Cast floating-point leaves to `dtype` (integer leaves such as indices are left alone)."""
    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)


def to_device(tree: T, device: torch.device | str) -> T:
    """Move every tensor leaf to `device`."""
    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)
