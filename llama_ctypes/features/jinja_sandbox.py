"""The Jinja sandbox chat templates render in: a template inside a downloaded GGUF is untrusted input.

Rendering uses jinja2's ``SandboxedEnvironment`` (no attribute walking to Python internals, no file or
network access) and three budgets: output size, total ``range()`` length and ``*`` results, and wall
time. A template that exceeds one raises :class:`ChatTemplateError`.

The wall time is checked between the template's lines, so no single operation
may run long: one C call (``str()``, ``json.dumps``, ``==``, a string ``+``)
holds the GIL, and with it every thread of a server, until it returns. Strings
joined with ``~`` or ``+`` are therefore bounded by the output budget before
they are built (doubling one 30 times took 6 GB and 17 s), and a container is
walked, shared references counted at each use, before anything serializes,
prints or compares it: ``[d, d]`` thirty levels deep is thirty lists but
2**30 leaves, which ``tojson``, ``string`` or ``==`` would visit one by one.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import sys
import threading
import time
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.nodes import EvalContext
from jinja2.runtime import Context
from jinja2.ext import Extension
from jinja2.sandbox import SandboxedEnvironment
from jinja2.utils import Namespace

from ..errors import LlamaError

__all__ = ["MAX_INT_BITS", "MAX_ITEMS", "MAX_OUTPUT_CHARS", "MAX_PRODUCED", "MAX_SECONDS", "ChatTemplateError",
           "compile_template", "render_template"]

#: Most characters a rendered prompt may have.
MAX_OUTPUT_CHARS = 4_000_000
#: Most items ``range()`` may produce, and most elements or characters a ``*`` may produce, per render.
MAX_ITEMS = 1_000_000
#: Characters (and items) that calls, filters, ``~``, ``+`` and ``*`` may produce in one render, all told: each
#: result may stay under the output budget while a loop keeps thousands of them alive (3,000 ``ljust`` results
#: of 4 MB took 6 GB in 4 s).
MAX_PRODUCED = 16 * MAX_OUTPUT_CHARS
#: Largest integer a template may compute, in bits: ``(((9**64)**64)**64)**64`` is one C multiplication of 23 s.
MAX_INT_BITS = 1 << 16
#: Wall-time budget of one render, in seconds.
MAX_SECONDS = 5.0

_TEMPLATE_FILENAME = "<chat_template>"


class ChatTemplateError(LlamaError, ValueError):
    """A chat template is missing, invalid, hostile, or raised an error while rendering."""


class _Budget:
    def __init__(self, seconds: float, items: int, chars: int):
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.items_left = items
        self.chars = chars
        self.produced = 0

    def produce(self, value: Any) -> Any:
        """Count a value built by the template against :data:`MAX_PRODUCED`; return it."""
        if isinstance(value, (str, list, tuple, dict)):
            self.produced += len(value)
            if self.produced > MAX_PRODUCED:
                raise ChatTemplateError(f"chat template built more than {MAX_PRODUCED} characters or items in all")
        return value

    def spend(self, n: int, what: str) -> None:
        self.items_left -= n
        if self.items_left < 0:
            raise ChatTemplateError(f"chat template exceeded its budget of {MAX_ITEMS} items ({what})")

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"chat template rendering took longer than {self.seconds:g} s")


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


# The budget of the render running in this thread (a template may render in several threads at once).
_state = threading.local()

_CONTAINERS = (list, tuple, dict, set, frozenset, Namespace)


def _children(value: Any) -> Any:
    if isinstance(value, dict):
        return itertools.chain(value, value.values())
    if isinstance(value, Namespace):
        return (object.__getattribute__(value, "_Namespace__attrs"),)
    return value


def _walk_size(value: Any, what: str) -> int:
    """Items in ``value`` counting every use of a shared object, as ``str()``, ``json.dumps`` and ``==`` visit
    them; ChatTemplateError beyond :data:`MAX_ITEMS` items or :data:`MAX_OUTPUT_CHARS` characters of strings,
    or for a container that holds itself. Each distinct container is visited once (its size is remembered),
    so counting a structure thirty levels of sharing deep costs thirty steps, not 2**30."""
    if isinstance(value, str):
        return len(value)
    if not isinstance(value, _CONTAINERS):
        return 1
    sizes: dict[int, tuple[int, int]] = {}  # id -> (items, characters), of the containers counted
    open_: set[int] = set()  # the containers whose children are being counted (the path to the current one)
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        item, counted = stack.pop()
        key = id(item)
        if counted:
            items, chars = 1, 0
            for child in _children(item):
                if isinstance(child, str):
                    items, chars = items + 1, chars + len(child)
                elif isinstance(child, _CONTAINERS):
                    child_items, child_chars = sizes[id(child)]
                    items, chars = items + child_items, chars + child_chars
                else:
                    items += 1
            if items > MAX_ITEMS or chars > MAX_OUTPUT_CHARS:
                raise ChatTemplateError(f"chat template would {what} a value of more than {MAX_ITEMS} items or "
                                        f"{MAX_OUTPUT_CHARS} characters (shared references count at each use)")
            sizes[key] = (items, chars)
            open_.discard(key)
        elif key not in sizes:
            if key in open_:
                raise ChatTemplateError(f"chat template would {what} a value that contains itself")
            open_.add(key)
            stack.append((item, True))
            stack.extend((child, False) for child in _children(item)
                         if isinstance(child, _CONTAINERS) and id(child) not in sizes)
    return sizes[id(value)][0]


def _check_walk(values: Any, what: str) -> None:
    for value in values:
        if isinstance(value, _CONTAINERS):
            _walk_size(value, what)


_COMPARE = {"eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "gt": lambda a, b: a > b,
            "gteq": lambda a, b: a >= b, "lt": lambda a, b: a < b, "lteq": lambda a, b: a <= b,
            "in": lambda a, b: a in b, "notin": lambda a, b: a not in b}


def _compare(left: Any, *ops: Any) -> Any:
    """A comparison chain (``a < b < c``), each container walked first: ``==`` on two nested structures is one C
    call as long as their walk."""
    result: Any = True
    for i in range(0, len(ops), 2):
        op, right = ops[i], ops[i + 1]
        if isinstance(left, _CONTAINERS) and (op in ("in", "notin") or isinstance(right, _CONTAINERS)):
            _check_walk((left, right), "compare")  # (`t in d` hashes a tuple: as deep a walk)
        result = _COMPARE[op](left, right)
        if not result:
            return result
        left = right
    return result


def _concat(values: tuple) -> str:
    """``a ~ b ~ ...``: bounded by the output budget before the string is built."""
    _check_walk(values, "print")
    parts = [v if isinstance(v, str) else str(v) for v in values]
    _check_size(sum(map(len, parts)))
    return _produced("".join(parts))


def _finalize(value: Any) -> Any:
    """Every ``{{ ... }}`` value before ``str()``."""
    if isinstance(value, _CONTAINERS):
        _walk_size(value, "print")
    return value


class _CodeGenerator(CodeGenerator):
    """jinja2's compiler, with ``~`` and comparisons routed through the checks above."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def visit_Compare(self, node: nodes.Compare, frame: Frame) -> None:
        self.write("environment.checked_compare(")
        self.visit(node.expr, frame)
        for op in node.ops:
            self.write(f", {op.op!r}, ")
            self.visit(op.expr, frame)
        self.write(")")


def _budget() -> _Budget | None:
    return getattr(_state, "budget", None)


class _Sandbox(SandboxedEnvironment):
    """The sandbox, with budgets on the two ways a template can allocate without bound."""

    # Routed through call_binop at render time (and never constant-folded at compile time).
    intercepted_binops = frozenset({"*", "**", "%", "+"})
    code_generator_class = _CodeGenerator
    checked_concat = staticmethod(_concat)
    checked_compare = staticmethod(_compare)

    # Every call a template makes (methods, globals, filters) is checked before it runs: no
    # legitimate template passes a size beyond the output budget, and the string operations
    # that multiply sizes (replace, join, indent) are estimated first.
    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
        _check_args(args, kwargs)
        _check_walk((*args, *kwargs.values()), "pass")
        name = getattr(__obj, "__name__", "")
        target = getattr(__obj, "__self__", None)
        if isinstance(target, str) and name in ("replace", "join") and args:
            _check_size(_estimate(name, target, args))
        if isinstance(target, str) and name == "expandtabs":  # (each tab becomes up to tabsize spaces)
            size = args[0] if args else kwargs.get("tabsize", 8)
            if isinstance(size, int):
                _check_size(len(target) + target.count("\t") * max(size, 0))
        return _produced(super().call(__context, __obj, *args, **kwargs))


    def wrap_str_format(self, value):
        # str.format with a huge width ('{:>1000000000}') would allocate before any output budget.
        wrapped = super().wrap_str_format(value)
        if wrapped is not None and _HUGE_WIDTH.search(value.__self__):
            raise ChatTemplateError("chat template used a format width larger than the output budget")
        return wrapped

    def unsafe_undefined(self, obj, attribute):
        # jinja2 would render an unsafe attribute as an empty string; refuse loudly instead.
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    def call_binop(self, context, operator, left, right):
        if operator == "+" and (isinstance(left, str) or isinstance(right, str)):
            # llama.cpp's engine joins a string with null or undefined as with "" (firefunction-v2
            # adds its undefined `functions` when there are no tools); keep its rendering.
            if left is None or isinstance(left, jinja2.Undefined):
                return right
            if right is None or isinstance(right, jinja2.Undefined):
                return left
        budget = _budget()
        if operator == "*" and budget is not None:
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    # ([[0] * 1000] * 1000) * 1000 is a billion items to print: count what is repeated, walked
                    budget.spend(_walk_size(seq, "repeat") * max(n, 0), "sequence repetition")
        if operator == "+":
            if isinstance(left, str) and isinstance(right, str):
                _check_size(len(left) + len(right))
            elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)) \
                    and len(left) + len(right) > MAX_ITEMS:
                raise ChatTemplateError(f"chat template would build a list of more than {MAX_ITEMS} items")
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
            raise ChatTemplateError("chat template used an exponent larger than 64")
        if operator in ("*", "**") and _is_int(left) and _is_int(right):
            bits = abs(left).bit_length() * right if operator == "**" else left.bit_length() + right.bit_length()
            if bits > MAX_INT_BITS:
                raise ChatTemplateError(f"chat template would compute an integer of more than {MAX_INT_BITS} bits")
        if operator == "%" and isinstance(left, str):
            _check_walk((right,), "print")
            widths = right if isinstance(right, tuple) else (right,)
            if _HUGE_PERCENT.search(left) or ("*" in left and any(isinstance(w, int) and w > MAX_OUTPUT_CHARS
                                                                  for w in widths)):
                raise ChatTemplateError("chat template used a format width larger than the output budget")
        return _produced(super().call_binop(context, operator, left, right))


def _json_default(value: Any) -> Any:
    # Filters such as map() hand tojson a generator; Undefined renders as null.
    if isinstance(value, jinja2.Undefined):
        return None
    if hasattr(value, "__iter__") and not isinstance(value, (str, bytes)):
        return list(value)
    return str(value)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Hugging Face's tojson: no HTML escaping, and the keyword options templates pass.
    if indent is not None:
        _check_size(_indentation(value, indent))
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys,
                      default=_json_default)


def _indentation(value: Any, indent: Any) -> int:
    """Characters of indentation ``json.dumps(value, indent=indent)`` writes: each item on a line of its own,
    indented once per level above it (quadratic in the depth; a template builds the depth for free). The
    value's own size was bounded before (every use of a shared object counted)."""
    width = len(indent) if isinstance(indent, str) else max(int(indent), 0) if _is_int(indent) else 0
    total = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, (list, tuple)) else None
        if children:
            total += width * ((depth + 1) * len(children) + depth)  # (its items, then its closing bracket)
            if total > MAX_OUTPUT_CHARS:
                break
            stack.extend((child, depth + 1) for child in children)
    return total


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _safe(value: Any) -> Any:
    # Autoescaping is off, so ``|safe`` has nothing to protect; as a Markup it would HTML-escape
    # whatever is concatenated to it ('"'|safe + x|tojson gives &#34;), which no prompt wants.
    return str(value) if isinstance(value, str) else value


# Template variables llama.cpp's ``preserve_reasoning`` sets (keep or drop past turns' thinking).
_HUGE_WIDTH = re.compile(r"\{[^{}]*:[^{}]*?\d{7,}")
_HUGE_PERCENT = re.compile(r"%[-#0 +]*\d{7,}")


def _check_args(args, kwargs) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_OUTPUT_CHARS:
            raise ChatTemplateError(f"chat template passed {value} to a function (over the output budget)")


def _estimate(name: str, value, args: tuple) -> int:
    """Upper bound of the result size of a string-multiplying operation."""
    if name == "replace" and isinstance(value, str) and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        return len(value) + (value.count(old) if old else len(value) + 1) * max(0, len(new) - len(old))
    if name == "join":
        sep, items = (value, args[0]) if isinstance(value, str) else (str(args[0]) if args else "", value)
        items = list(items) if not isinstance(items, (list, tuple, str)) else items
        return len(sep) * max(0, len(items) - 1) + sum(len(str(i)) for i in items)
    if name == "indent" and isinstance(value, str):
        width = args[0] if args and isinstance(args[0], int) else 4
        return len(value) + (value.count("\n") + 1) * (width if isinstance(width, int) else len(str(width)))
    return 0


#: Filters that never walk into their arguments (no str(), serialization, comparison or hashing of items):
#: checked without walking them, as templates call some in loops over every message.
_SHALLOW_FILTERS = frozenset({"length", "count", "first", "last", "list", "reverse", "select", "reject",
                              "selectattr", "rejectattr", "map", "batch", "slice", "attr", "default", "d", "items",
                              "random", "abs", "round", "int", "float", "bool", "safe"})


def _checked_filter(name: str, fn):
    @functools.wraps(fn)  # keeps jinja2's pass_context / pass_eval_context marker
    def checked(*args, **kwargs):
        plain = [a for a in args if not isinstance(a, (EvalContext, Context, jinja2.Environment))]
        _check_args(plain[1:], kwargs)
        if name not in _SHALLOW_FILTERS:
            _check_walk((*plain, *kwargs.values()), f"apply |{name} to")
        if name == "sum" and plain and isinstance(plain[0], (list, tuple)):
            _check_sum(plain[0], kwargs.get("start", plain[3] if len(plain) > 3 else 0))
        if name in ("replace", "join", "indent") and plain and isinstance(plain[0], (str, list, tuple)):
            _check_size(_estimate(name, plain[0], tuple(plain[1:])))
        if name in ("batch", "slice") and len(plain) > 1 and _is_int(plain[1]) \
                and (name == "slice" or len(plain) > 2 or kwargs.get("fill_with") is not None):
            # |batch(n, fill) pads its last group to n items, |slice(n) makes n groups: items from nothing,
            # inside lists whose own length is all the produced count sees
            budget = _budget()
            if budget is not None:
                budget.spend(max(plain[1], 0), f"|{name}")
        return _produced(fn(*args, **kwargs))

    return checked


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _produced(value: Any) -> Any:
    budget = _budget()
    return value if budget is None else budget.produce(value)


def _check_sum(items: Sequence[Any], start: Any) -> None:
    # |sum over lists or strings copies the running total at each step: quadratic in their number
    if not isinstance(start, (list, tuple, str)):
        return
    total = copied = len(start)
    for item in items:
        total += len(item) if isinstance(item, (list, tuple, str)) else 1
        copied += total
        if copied > MAX_ITEMS:
            raise ChatTemplateError(f"chat template's |sum would copy more than {MAX_ITEMS} items")


def _check_size(n: int) -> None:
    if n > MAX_OUTPUT_CHARS:
        raise ChatTemplateError(f"chat template would build a string of {n} characters (over the output budget)")


def _center(value: str, width: int = 80) -> str:
    if width > MAX_OUTPUT_CHARS:
        raise ChatTemplateError(f"chat template asked center() for {width} characters")
    return str(value).center(width)


def _make_env() -> _Sandbox:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=False,
        extensions=["jinja2.ext.loopcontrols", _GenerationTag],
        undefined=jinja2.Undefined,
        # No constant folding: a folded expression ('x'|center(10**9)) runs at compile time,
        # before any budget applies.
        optimized=False,
        finalize=_finalize,
    )
    env.filters["center"] = _center
    env.filters["tojson"] = _tojson
    env.filters["safe"] = _safe
    # Compiled templates call filters directly, so the size checks wrap each filter.
    for name, fn in list(env.filters.items()):
        env.filters[name] = _checked_filter(name, fn)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _budgeted_range
    return env


def _budgeted_range(*args: int) -> range:
    r = range(*args)
    budget = _budget()
    if budget is not None:
        budget.spend(len(r), "range()")
    return r


def _render_traced(template: jinja2.Template, context: Mapping[str, Any], budget: _Budget) -> str:
    """Render with a tracer that enforces the time budget inside the template's own frames."""

    def local_trace(frame, event, arg):
        if event == "line":
            budget.check_time()
        return local_trace

    def global_trace(frame, event, arg):
        if frame.f_code.co_filename == _TEMPLATE_FILENAME:
            return local_trace
        return None

    previous = sys.gettrace()
    sys.settrace(global_trace)
    try:
        out: list[str] = []
        size = 0
        for chunk in template.generate(**context):
            size += len(chunk)
            if size > budget.chars:
                raise ChatTemplateError(f"chat template output exceeded {budget.chars} characters")
            out.append(chunk)
        return "".join(out)
    finally:
        sys.settrace(previous)


def compile_template(source: str) -> jinja2.Template:
    """``source`` compiled in a new sandbox; ChatTemplateError on a syntax error."""
    env = _make_env()
    try:
        # Compiled with a fixed file name, so the tracer can recognise the template's frames.
        code = env.compile(source, name=None, filename=_TEMPLATE_FILENAME)
        return env.template_class.from_code(env, code, env.make_globals(None), None)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"invalid chat template (line {exc.lineno}): {exc.message}") from exc


def render_template(template: jinja2.Template, context: Mapping[str, Any], timeout: float = MAX_SECONDS) -> str:
    """``template`` (from :func:`compile_template`) rendered over ``context`` within the budgets, ``timeout``
    in seconds; every failure of the template, and every budget overrun, raises ChatTemplateError."""
    budget = _Budget(timeout, MAX_ITEMS, MAX_OUTPUT_CHARS)
    _state.budget = budget
    try:
        return _render_traced(template, context, budget)
    except ChatTemplateError:
        raise
    except jinja2.exceptions.SecurityError as exc:
        raise ChatTemplateError(f"the chat template tried an unsafe operation: {exc}") from exc
    except jinja2.UndefinedError as exc:
        raise ChatTemplateError(f"the chat template failed: UndefinedError: {exc} (if the template expects "
                                "a variable of its own, pass it with template_kwargs={...})") from exc
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
            ArithmeticError, RecursionError, MemoryError) as exc:
        raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from exc
    finally:
        _state.budget = None
