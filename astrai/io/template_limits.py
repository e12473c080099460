"""Resource limits for rendering untrusted chat templates (`astrai.io.chat_template` compiles with them).

jinja2's sandbox keeps a template away from Python internals and caps `range()` at 100,000 items, but bounds neither
what a template allocates nor how long it loops: `{{ 'x' * 10**10 }}` asks for 10 GB at once, two nested loops over
`range(100000)` run for hours, and one loop can write gigabytes of output. `BoundedEnvironment` adds, per render:

- a size limit on values, `MAX_ITEMS` characters or items (`MAX_INT_BITS` bits for an int), checked *before* the
  operations that could exceed it: the operators `*`, `+`, `%`, `**` (the sandbox's binop interception), the
  padding, replacing and joining str methods, the filters that pad or repeat, and the `lipsum` global. Values that
  get stringified (output, `~`, the filters that call `str()`) are first measured by a walk that stops at the limit,
  so a list holding itself a thousand times over cannot blow up inside `str()`. `check_value` is also what the
  template `namespace` applies to stored values.
- `MAX_ITERATIONS` loop iterations, all `{% for %}` loops of the render together.
- `MAX_OUTPUT` characters written by the render's output statements, counted where they run (inside macros and
  `{% set %}` blocks too, whose output jinja buffers before returning it).

The two counters are inserted into the template's syntax tree at compile time: each loop's iterable and each
output expression passes through a filter that counts. They apply inside `counting()`, which
`render_chat_template` opens around each render. A template past a limit raises `TemplateLimitError` (a jinja2
SecurityError) naming it. Not bounded: the CPU time of a single operation (comparing two large shared structures)
and recursion depth (Python's recursion limit ends it with a RecursionError).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import re
import string
from collections.abc import Iterable, Iterator
from typing import Any

import jinja2
import jinja2.nodes as nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_ITEMS = 1 << 24
"""Most characters of a string (items of a list, tuple or dict) a template may build: 16.7M."""
MAX_INT_BITS = 1 << 16
"""Largest int a template may build, in bits (about 19,700 decimal digits)."""
MAX_OUTPUT = 1 << 26
"""Most characters a render's output statements may write in all: 67M (a prompt is rarely over 1M)."""
MAX_ITERATIONS = 1 << 23
"""Most loop iterations of one render, all loops together: 8.4M (0.4 s of empty loop bodies here; a conversation
of 10,000 messages over a template with a few loops per message uses well under 1M)."""

MAX_JSON_INDENT = 64
"""Widest `tojson(indent=...)`: the indent repeats per nesting level on every line, so it multiplies the size."""

_LOOP_FILTER, _OUTPUT_FILTER, _VALUE_FILTER = "__astrai_loop", "__astrai_output", "__astrai_value"
# filters that pad, repeat or replace text: their numeric and string arguments are checked before the call
_WIDTH_FILTERS = frozenset({"center", "indent", "wordwrap", "truncate", "batch", "slice", "tojson"})
# filters that stringify an argument (soft_str, json, pprint): container arguments are measured first
_TEXT_FILTERS = frozenset({"capitalize", "center", "e", "escape", "forceescape", "format", "indent", "join", "lower",
                           "pprint", "replace", "safe", "string", "striptags", "title", "tojson", "trim", "truncate",
                           "upper", "urlencode", "urlize", "wordcount", "wordwrap", "xmlattr"})  # fmt: skip
_FORMAT_NUMBER = re.compile(r"\d+")
_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[diouxXeEfFgGcrsa]")


class TemplateLimitError(jinja2.exceptions.SecurityError):
    """A chat template went past a resource limit of `astrai.io.template_limits` (the message says which)."""


@dataclasses.dataclass
class _Counters:
    iterations: int = 0
    output: int = 0


_COUNTERS: contextvars.ContextVar[_Counters | None] = contextvars.ContextVar("astrai_template_counters", default=None)


@contextlib.contextmanager
def counting() -> Iterator[None]:
    """Count loop iterations and output characters against the limits for the renders inside (one conversation)."""
    token = _COUNTERS.set(_Counters())
    try:
        yield
    finally:
        _COUNTERS.reset(token)


def _too_big(what: str, size: int, limit: int = MAX_ITEMS) -> TemplateLimitError:
    return TemplateLimitError(f"{what} would be {size:,} long, over the chat-template limit of {limit:,}")


def check_value(value: Any, what: str = "a value") -> Any:
    """`value`, or TemplateLimitError when it is a string or container over MAX_ITEMS or an int over MAX_INT_BITS."""
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise _too_big(f"{what} (an int, in bits)", value.bit_length(), MAX_INT_BITS)
    if isinstance(value, str | list | tuple | dict) and len(value) > MAX_ITEMS:
        raise _too_big(what, len(value))
    return value


def text_size(value: Any, limit: int = MAX_ITEMS) -> int:
    """About how many characters `str(value)` has, found by a walk that raises as soon as it passes `limit`.

    Containers may share items (`[x, x]` nested thirty deep prints 2**30 copies of x), so their length says nothing;
    the walk visits what `str()` would print and stops early instead of letting `str()` allocate.
    """
    if isinstance(value, str):
        if len(value) > limit:
            raise _too_big("text", len(value), limit)
        return len(value)
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, jinja2.utils.Namespace):
            item = object.__getattribute__(item, "_Namespace__attrs")
        if isinstance(item, str):
            total += len(item) + 2
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 1
        elif isinstance(item, list | tuple | set | frozenset):
            total += 2 + 2 * len(item)
            if total <= limit:
                stack.extend(item)
        elif isinstance(item, dict):
            total += 2 + 4 * len(item)
            if total <= limit:
                stack.extend(item.keys())
                stack.extend(item.values())
        else:
            total += 8
        if total > limit:
            raise _too_big("the text of a value", total, limit)
    return total


def _binop_size(operator: str, left: Any, right: Any) -> tuple[str, int, int] | None:
    """(what, size, limit) of the result of `left operator right` when it can be large; computed without it."""
    sized = (str, list, tuple)
    if operator == "*":
        if isinstance(left, int) and isinstance(right, sized):
            left, right = right, left
        if isinstance(left, sized) and isinstance(right, int):
            return "a repeated value", len(left) * max(right, 0), MAX_ITEMS
        if isinstance(left, int) and isinstance(right, int):
            return "a product (in bits)", left.bit_length() + right.bit_length(), MAX_INT_BITS
    if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        return "a concatenation", len(left) + len(right), MAX_ITEMS
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        return "a power (in bits)", right * (abs(left).bit_length() - 1) + 1, MAX_INT_BITS
    if operator == "%" and isinstance(left, str):
        _check_format(left, right if isinstance(right, tuple) else (right,))
    return None


def _format_widths(fmt: str) -> tuple[list[str], bool]:
    """(the width and precision numbers of `fmt`'s fields, whether a field takes them from the arguments), for
    printf-style (`%-10.3s`, `%*d`) and str.format-style (`{:>10}`, `{:{}}`) fields; literal text is ignored."""
    printf = [m.groups() for m in _PRINTF_FIELD.finditer(fmt.replace("%%", ""))]
    numbers = [n for field in printf for n in field if n and n != "*"]
    from_args = any("*" in field for field in printf)
    try:
        specs = [spec for _, name, spec, _ in string.Formatter().parse(fmt) if name is not None and spec]
    except ValueError:  # not a valid str.format string: str.format would raise first
        specs = []
    numbers += [n for spec in specs for n in _FORMAT_NUMBER.findall(spec)]
    return numbers, from_args or any("{" in spec for spec in specs)


def _check_format(fmt: str, args: Iterable[Any]) -> None:
    """Refuse a printf- or str.format-style format whose widths or precisions pass MAX_ITEMS (`'%9999999999s'`),
    including widths taken from the arguments (`'%*s'`, `'{:{}}'`), and arguments too long to print."""
    numbers, from_args = _format_widths(fmt)
    args = list(args)
    if any(len(n) > 9 or int(n) > MAX_ITEMS for n in numbers) or (
        from_args and any(isinstance(a, int) and abs(a) > MAX_ITEMS for a in args)
    ):
        raise TemplateLimitError(f"a format width over the chat-template limit of {MAX_ITEMS:,}")
    for arg in args:
        text_size(arg)


def _check_str_method(method: Any, args: tuple, kwargs: dict) -> None:
    """Refuse the str method calls that would build a string over MAX_ITEMS, before they run."""
    text, name = method.__self__, method.__name__
    if name in ("ljust", "rjust", "center", "zfill") and args and isinstance(args[0], int):
        size = args[0]
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        size = len(text) + text.count("\t") * max(tab, 0) if isinstance(tab, int) else 0
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        found = text.count(args[0]) if args[0] else len(text) + 1
        size = len(text) + found * max(len(args[1]) - len(args[0]), 0)
    elif name == "join" and args and isinstance(args[0], list | tuple):
        size = sum(text_size(item) for item in args[0]) + len(text) * max(len(args[0]) - 1, 0)
    elif name in ("format", "format_map"):
        _check_format(text, [*args, *kwargs.values()])
        return
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        size = len(text) * longest
    else:
        return
    if size > MAX_ITEMS:
        raise _too_big(f"the result of str.{name}", size)


_PASSED = (jinja2.runtime.Context, jinja2.Environment, nodes.EvalContext)  # what pass_context & co. prepend


def _check_filter_args(name: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """Refuse a filter call whose result would pass MAX_ITEMS, judged from its arguments (`args`: the positional
    ones, without the context jinja passes)."""
    values = [*args, *kwargs.values()]
    if name in _TEXT_FILTERS:
        for value in values:
            text_size(value)
    if name in _WIDTH_FILTERS:
        for value in values:
            if isinstance(value, int) and abs(value) > MAX_ITEMS:
                raise TemplateLimitError(f"filter {name}: argument {value:,} is over the limit of {MAX_ITEMS:,}")
    if name == "indent" and args and isinstance(args[0], str):
        width = kwargs.get("width", args[1] if len(args) > 1 else 4)
        pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        size = len(args[0]) + (args[0].count("\n") + 1) * pad
        if size > MAX_ITEMS:
            raise _too_big("the result of filter indent", size)
    if name == "replace" and len(args) >= 3 and all(isinstance(v, str) for v in args[:3]):
        _check_str_method(args[0].replace, (args[1], args[2]), {})
    if name == "format" and args and isinstance(args[0], str):
        _check_format(args[0], values[1:])
    indent = kwargs.get("indent", args[2] if name == "tojson" and len(args) > 2 else None)
    if name == "tojson" and isinstance(indent, int | str) and not isinstance(indent, bool):
        if (len(indent) if isinstance(indent, str) else indent) > MAX_JSON_INDENT:
            raise TemplateLimitError(f"tojson indent {indent!r} is over the limit of {MAX_JSON_INDENT}")


def bounded_filter(name: str, func: Any) -> Any:
    """`func` (a jinja filter) with its arguments checked against the limits first and its result after."""

    @functools.wraps(func)  # keeps jinja_pass_arg (pass_context, pass_eval_context, ...)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_filter_args(name, [a for a in args if not isinstance(a, _PASSED)], kwargs)
        return check_value(func(*args, **kwargs), f"the result of filter {name}")

    return bounded


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 -- jinja's names
    if not all(isinstance(v, int) for v in (n, min, max)) or n * max > MAX_ITEMS // 8:
        raise TemplateLimitError(f"lipsum({n}, max={max}) is over the chat-template limit")
    return jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max)


# The counting filters take the context only so that jinja's optimizer cannot run them at compile time on
# constant arguments (it folds filters that do not), which would count nothing at render time.
@jinja2.pass_context
def _count_loop(_: jinja2.runtime.Context, iterable: Any) -> Any:
    counters = _COUNTERS.get()
    if counters is None:
        return iterable

    def counted() -> Iterator[Any]:
        for item in iterable:
            counters.iterations += 1
            if counters.iterations > MAX_ITERATIONS:
                raise TemplateLimitError(f"the chat template ran over {MAX_ITERATIONS:,} loop iterations")
            yield item

    return counted()


@jinja2.pass_context
def _count_output(_: jinja2.runtime.Context, value: Any) -> Any:
    size = text_size(value)
    counters = _COUNTERS.get()
    if counters is not None:
        counters.output += size
        if counters.output > MAX_OUTPUT:
            raise TemplateLimitError(f"the chat template wrote over {MAX_OUTPUT:,} characters")
    return value


@jinja2.pass_context
def _measured(_: jinja2.runtime.Context, value: Any) -> Any:
    text_size(value)
    return value


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with the limits of this module (see the module docstring)."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.filters = {name: bounded_filter(name, f) for name, f in self.filters.items()}
        self.filters |= {_LOOP_FILTER: _count_loop, _OUTPUT_FILTER: _count_output, _VALUE_FILTER: _measured}
        self.globals["lipsum"] = _lipsum

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        """The operator, refused first when its result would pass a limit."""
        size = _binop_size(operator, left, right)
        if size is not None and size[1] > size[2]:
            raise _too_big(size[0], size[1], size[2])
        return check_value(super().call_binop(context, operator, left, right), "an operator's result")

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        """A call from the template; str methods that pad, replace or join are checked before they run."""
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        if isinstance(getattr(method, "__self__", None), str):
            _check_str_method(method, args, kwargs)
        return check_value(super().call(__context, __obj, *args, **kwargs), "a call's result")

    def from_string(self, source: str | nodes.Template, *args: Any, **kwargs: Any) -> jinja2.Template:  # type: ignore[override]
        """Compile `source` with the loop and output counters inserted into its syntax tree."""
        tree = self.parse(source) if isinstance(source, str) else source
        _insert_counters(tree)
        return super().from_string(tree, *args, **kwargs)


def _filter(node: nodes.Expr, name: str) -> nodes.Filter:
    return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)


def _insert_counters(tree: nodes.Template) -> None:
    """Route every loop iterable, output expression and `~` operand through the counting filters (in place)."""
    for loop in tree.find_all(nodes.For):
        loop.iter = _filter(loop.iter, _LOOP_FILTER)
    for output in tree.find_all(nodes.Output):
        output.nodes = [_filter(nodes.Const(n.data, lineno=n.lineno) if isinstance(n, nodes.TemplateData) else n,
                                _OUTPUT_FILTER) for n in output.nodes]  # fmt: skip
    for concat in tree.find_all(nodes.Concat):
        concat.nodes = [_filter(n, _VALUE_FILTER) for n in concat.nodes]
