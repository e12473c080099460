"""Pytree registration of attrs trees: flatten/unflatten, names, compile and grad (DESIGN F1-F3)."""

import attrs
import pytest
import torch
import torch.utils._pytree as pt

from astrai import tree
from astrai.tree import pytree, replace, static


@pytree
@attrs.frozen(eq=False)
class Leaf:
    w: torch.Tensor
    b: torch.Tensor | None = None


@pytree
@attrs.frozen(eq=False)
class Net:
    layers: tuple[Leaf, ...]
    head: Leaf
    group: int = static(default=4)


def _net():
    return Net(
        layers=(Leaf(w=torch.randn(3, 2), b=torch.zeros(3)), Leaf(w=torch.randn(3, 3))), head=Leaf(w=torch.ones(1))
    )


def test_flatten_roundtrip_keeps_static_and_none():
    net = _net()
    flat, spec = pt.tree_flatten(net)
    rebuilt = pt.tree_unflatten(flat, spec)
    assert isinstance(rebuilt, Net) and rebuilt.group == 4 and rebuilt.layers[1].b is None
    assert torch.equal(rebuilt.layers[0].w, net.layers[0].w)


def test_named_leaves_are_checkpoint_names():
    names = list(tree.named_tensors(_net()))
    assert names == ["layers.0.w", "layers.0.b", "layers.1.w", "head.w"]
    net = _net()
    rebuilt = tree.from_named_tensors(net, {k: v * 2 for k, v in tree.named_tensors(net).items()})
    assert torch.equal(rebuilt.layers[1].w, net.layers[1].w * 2)
    partial = {k: v for k, v in tree.named_tensors(net).items() if k != "head.w"}
    with pytest.raises(KeyError, match="head.w"):
        tree.from_named_tensors(net, partial)


def test_replace_count_cast_device():
    net = _net()
    other = replace(net, head=Leaf(w=torch.zeros(5)))
    assert other.head.w.shape == (5,) and other.layers is net.layers
    with pytest.raises(TypeError, match="no field"):
        replace(net, nope=1)
    assert tree.count(net) == 6 + 3 + 9 + 1
    assert tree.nbytes(tree.cast(net, torch.bfloat16)) == 2 * tree.count(net)
    assert all(t.device.type == "meta" for t in tree.leaves(tree.to_device(net, "meta")))


def test_compiled_function_and_grad_over_tree():
    net = _net()

    def loss(n: Net, x: torch.Tensor) -> torch.Tensor:
        h = x @ n.layers[0].w.T + n.layers[0].b
        h = replace(n.layers[1], w=n.layers[1].w * 2).w @ h.T
        return h.square().sum() * n.group

    x = torch.randn(5, 2)
    compiled = torch.compile(loss, fullgraph=True)
    torch.testing.assert_close(compiled(net, x), loss(net, x))
    grads = torch.func.grad(loss)(net, x)
    assert isinstance(grads, Net) and grads.head.w.eq(0).all()
    w = net.layers[0].w.clone().requires_grad_()
    loss(replace(net, layers=(replace(net.layers[0], w=w), net.layers[1])), x).backward()
    torch.testing.assert_close(grads.layers[0].w, w.grad)
