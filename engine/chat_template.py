"""Chat templates rendered in jinja2's sandbox, within bounds on time and size.

A chat template is Jinja code. The operator's (the tokenizer's own, or ``--chat-template``) and, with
``--trust-request-chat-template``, a request's render here: in an ``ImmutableSandboxedEnvironment`` set up
as transformers' ``apply_chat_template`` sets up its own (``trim_blocks``, ``lstrip_blocks``, the
``loopcontrols`` extension, the ``{% generation %}`` tag, ``raise_exception``, ``strftime_now``, ``dict``,
``namespace`` and a ``tojson`` that keeps non-ASCII text), so real templates render the same text. On top
of jinja2's sandbox (no underscore attributes, no mutation of lists and dicts, ``range`` of at most
100,000 items) the environment bounds:

- time: every ``for`` iteration, call, intercepted operator, filter and output chunk checks a
  wall-clock deadline (``TemplateLimits.max_render_s``), so an endless or nested loop stops inside the
  render and leaves no thread busy;
- size: ``*``, ``**``, ``+``, ``%``, ``~``, string methods (``join``, ``ljust``, ``center``, ``replace``,
  ``format`` ...) and filters (``join``, ``center``, ``indent``, ``format``, ``batch`` ...) refuse a
  result longer than ``TemplateLimits.max_output_chars`` before they build it, as does every buffered
  block (macros, ``set`` blocks) and the rendered text itself.

A template that crosses a bound, does not compile, or raises, is a ``ChatTemplateError`` (a
``ValueError``) naming the bound or the cause; ``param`` says which request field to blame. Compiled
templates are kept in a bounded LRU keyed by the template text.

Rendering is blocking CPU work: the server calls it from a worker thread.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
import re
import string
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment

CONTINUE_FINAL_MESSAGE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""Appended to the final message to find where its text ends in the rendered chat (transformers' trick)."""
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""Names a message's reasoning goes by; transformers copies it under the first two for templates."""


@dataclass(frozen=True)
class TemplateLimits:
    """Bounds on rendering one chat template (the operator's and a request's alike)."""

    max_render_s: float = 1.0
    """Wall-clock seconds one render may take, compiling included; checked inside the render (every loop
    iteration, call and output chunk), so a template over it stops at once and is a 400."""
    max_output_chars: int = 1 << 20
    """Longest rendered text, and longest string, list or dict built while rendering (characters or
    items). ``for_max_model_len`` derives it from the model's context length."""
    max_template_chars: int = 256 * 1024
    """Longest template text a request may carry (its compile time grows with it); the operator's is not
    bounded."""
    max_int_bits: int = 1 << 16
    """Largest integer (in bits) ``*`` and ``**`` may build (big-integer arithmetic cannot be stopped
    midway)."""
    max_json_indent_chars: int = 64
    """Longest ``indent`` and ``separators`` of the ``tojson`` filter."""
    max_cached_templates: int = 64
    """Compiled templates kept (an LRU keyed by template text; request templates are user-controlled)."""

    def __post_init__(self) -> None:
        if not self.max_render_s > 0:
            raise ValueError(f"TemplateLimits.max_render_s must be > 0 seconds, got {self.max_render_s}.")
        for name in ("max_output_chars", "max_template_chars", "max_int_bits", "max_json_indent_chars",
                     "max_cached_templates"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TemplateLimits.{name} must be a positive integer, got {value!r}.")

    @classmethod
    def for_max_model_len(cls, max_model_len: int, chars_per_token: int = 32,
                          min_output_chars: int = 1 << 20) -> "TemplateLimits":
        """Limits whose ``max_output_chars`` is ``max_model_len * chars_per_token``, at least
        ``min_output_chars``: far more text than the model's context can hold, so only runaway
        templates reach it."""
        return cls(max_output_chars=max(min_output_chars, int(max_model_len) * chars_per_token))


class ChatTemplateError(ValueError):
    """A chat template could not render: it does not compile, it raised, its input is not a
    conversation, or it crossed a bound of ``TemplateLimits``."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param
        """The request field to blame: ``chat_template`` (the request's template) or ``messages``."""


class TemplateBoundExceeded(Exception):
    """Raised inside a render when a bound is crossed (not a ``ValueError``, so that no filter's
    ``except ValueError`` swallows it); ``render_chat_template`` turns it into a ``ChatTemplateError``."""


# ----------------------------------------------------------------------------------------
# The bounds of the render in progress (per thread / task)
# ----------------------------------------------------------------------------------------
class _Budget:
    """One render's deadline and size bound."""

    __slots__ = ("deadline", "limits")

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.max_render_s

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBoundExceeded(
                f"rendering took longer than {self.limits.max_render_s:g} s (the chat template time bound, "
                "TemplateLimits.max_render_s)")

    def check_size(self, size: int, what: str = "a value") -> None:
        if size > self.limits.max_output_chars:
            raise TemplateBoundExceeded(
                f"{what} reaches {size} characters or items, beyond the chat template size bound of "
                f"{self.limits.max_output_chars} (TemplateLimits.max_output_chars)")


_UNBOUNDED_TIME = float("inf")
_current: contextvars.ContextVar[Optional[_Budget]] = contextvars.ContextVar("chat_template_budget",
                                                                            default=None)
_COMPILE_TIME_BUDGET = _Budget(TemplateLimits())
"""Outside a render (jinja2 folds constant filter calls while compiling): the default size bounds."""
_COMPILE_TIME_BUDGET.deadline = _UNBOUNDED_TIME


def _budget() -> _Budget:
    return _current.get() or _COMPILE_TIME_BUDGET


def _weight(value: Any, cap: int) -> int:
    """Characters of the strings in ``value`` plus its items, counted through lists, dicts and
    namespaces (each reference counted: ``[s] * 3`` weighs three ``s``); stops counting past ``cap``.
    What ``str(value)`` or ``tojson`` would write grows with it."""
    total = 0
    stack = [value]
    seen_namespaces: set[int] = set()
    while stack:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v)
        elif isinstance(v, dict):
            total += len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += len(v)
            stack.extend(v)
        elif isinstance(v, jinja2.utils.Namespace):
            if id(v) in seen_namespaces:
                continue
            seen_namespaces.add(id(v))
            attrs = v._Namespace__attrs  # type: ignore[attr-defined]
            total += len(attrs)
            stack.extend(attrs.values())
        else:
            total += 1
        if total > cap:
            break
    return total


def _sized(value: Any) -> bool:
    return isinstance(value, (str, bytes, list, tuple, dict, set, frozenset, jinja2.utils.Namespace))


def _check_value(value: Any, what: str = "a value") -> Any:
    if _sized(value):
        budget = _budget()
        budget.check_size(_weight(value, budget.limits.max_output_chars), what)
    return value


def _int_arg(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _chars(value: Any) -> int:
    """About how many characters ``str(value)`` has (exact for a string), without building it."""
    if isinstance(value, str):
        return len(value)
    return _weight(value, _budget().limits.max_output_chars) + 1


# ----------------------------------------------------------------------------------------
# Pre-checks: refuse a result before it is built
# ----------------------------------------------------------------------------------------
_DIGITS = re.compile(r"\d+")


def _percent_widths(fmt: str) -> list[str]:
    """The widths and precisions of ``fmt``'s ``%`` conversions (digits, or ``*``: from the arguments);
    one linear scan (no regex backtracking on a hostile format string)."""
    out: list[str] = []
    i, n = fmt.find("%"), len(fmt)
    while 0 <= i < n - 1:
        j = i + 1
        if fmt[j] == "%":
            i = fmt.find("%", j + 1)
            continue
        if fmt[j] == "(":
            close = fmt.find(")", j)
            if close < 0:
                break
            j = close + 1
        while j < n and fmt[j] in "-#0 +":
            j += 1
        for _ in range(2):                     # width, then .precision
            k = j
            while k < n and (fmt[k].isdigit() or (k == j and fmt[k] == "*")):
                k += 1
                if fmt[k - 1] == "*":
                    break
            if k > j:
                out.append(fmt[j:k])
            j = k
            if j < n and fmt[j] == ".":
                j += 1
            else:
                break
        i = fmt.find("%", j)
    return out


def _brace_specs(fmt: str) -> list[str]:
    """The format specs of ``fmt``'s ``{...:spec}`` fields (Python's own linear parser); a malformed
    string has none here (``format`` itself then refuses it)."""
    try:
        return [spec for _, name, spec, _ in _string_formatter.parse(fmt) if name is not None and spec]
    except ValueError:
        return []


_string_formatter = string.Formatter()


def _check_format(fmt: str, args: Iterable[Any]) -> None:
    """``fmt.format(...)`` / ``fmt % args``: no width or precision beyond the size bound, written in the
    format string or (``{:{}}``, ``%*d``) taken from the arguments, and no result beyond it (every
    field may repeat the longest argument)."""
    budget = _budget()
    args = list(args)
    specs = _brace_specs(fmt) if "{" in fmt else []
    widths = _percent_widths(fmt) if "%" in fmt else []
    widths += [w for spec in specs for w in _DIGITS.findall(spec)]
    if "*" in widths or any("{" in spec for spec in specs):
        widths += [str(_int_arg(a)) for a in args]
    for digits in widths:
        if digits != "*":
            budget.check_size(int(digits) if len(digits) < 12 else 10 ** 12, "a format width")
    fields = fmt.count("%") + fmt.count("{")
    longest = max((_chars(a) for a in args), default=0)
    budget.check_size(len(fmt) + fields * longest, "a format result")


def _format_args(right: Any) -> list[Any]:
    if isinstance(right, Mapping):
        return list(right.values())
    if isinstance(right, tuple):
        return list(right)
    return [right]


def _check_binop(operator: str, left: Any, right: Any) -> None:
    budget = _budget()
    cap = budget.limits.max_output_chars
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if _sized(seq) and isinstance(n, int):
                budget.check_size(_weight(seq, cap) * max(n, 0), f"'{operator}' repetition")
                return
        if isinstance(left, int) and isinstance(right, int):
            _check_int_bits(abs(left).bit_length() + abs(right).bit_length())
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0:
            _check_int_bits(max(abs(left).bit_length() - 1, 0) * right)
    elif operator == "+":
        if _sized(left) and _sized(right):
            budget.check_size(_weight(left, cap) + _weight(right, cap), "'+' concatenation")
    elif operator == "%" and isinstance(left, str):
        _check_format(left, _format_args(right))


def _check_int_bits(bits: int) -> None:
    limit = _budget().limits.max_int_bits
    if bits > limit:
        raise TemplateBoundExceeded(f"an integer of about {bits} bits exceeds the chat template bound of "
                                    f"{limit} bits (TemplateLimits.max_int_bits)")


def _check_str_method(method: Any, args: tuple, kwargs: dict) -> tuple:
    """Pre-check a call of a ``str`` method that can grow its string; returns the arguments to call with
    (``join``'s iterable, materialized)."""
    s = method.__self__
    name = method.__name__
    budget = _budget()
    if name == "join" and args:
        items = list(args[0])
        budget.check_size(sum(_chars(x) for x in items) + len(s) * max(len(items) - 1, 0), "'join'")
        return (items,) + args[1:]
    if name in ("ljust", "rjust", "center", "zfill") and args:
        budget.check_size(_int_arg(args[0]), f"'{name}' width")
    elif name == "expandtabs":
        tab = _int_arg(args[0] if args else kwargs.get("tabsize", 8))
        budget.check_size(len(s) + s.count("\t") * tab, "'expandtabs'")
    elif name == "replace" and len(args) >= 2:
        old, new = args[0], args[1]
        if isinstance(old, str) and isinstance(new, str):
            count = s.count(old) if old else len(s) + 1
            if len(args) > 2 and _int_arg(args[2]) >= 0:
                count = min(count, _int_arg(args[2]))
            budget.check_size(len(s) + count * (len(new) - len(old)), "'replace'")
    return args


# ----------------------------------------------------------------------------------------
# Filters: transformers' tojson, and jinja2's own with size pre-checks
# ----------------------------------------------------------------------------------------
def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' ``tojson``: ``json.dumps`` without HTML escaping, non-ASCII kept."""
    limit = _budget().limits.max_json_indent_chars
    spacing = [indent] + list(separators or ())
    if any((_int_arg(v) if isinstance(v, int) else len(str(v))) > limit for v in spacing if v is not None):
        raise TemplateBoundExceeded(f"tojson's indent and separators are limited to {limit} characters "
                                    "(the chat template bound TemplateLimits.max_json_indent_chars)")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _precheck_filter(name: str, a: dict[str, Any]) -> None:
    """Size pre-checks of jinja2's growing filters, given their bound arguments."""
    budget = _budget()
    if name == "center":
        budget.check_size(_int_arg(a.get("width")), "'center' width")
    elif name == "indent":
        s, width = str(a.get("s", "")), a.get("width")
        w = _int_arg(width) if isinstance(width, int) else len(str(width))
        budget.check_size(len(s) + (s.count("\n") + 1) * w, "'indent'")
    elif name == "wordwrap":
        s, wrap = str(a.get("s", "")), a.get("wrapstring")
        budget.check_size((len(s) + 1) * len(str(wrap or "\n")), "'wordwrap'")
    elif name == "replace":
        s, old, new = str(a.get("s", "")), str(a.get("old", "")), str(a.get("new", ""))
        count = s.count(old) if old else len(s) + 1
        if a.get("count") is not None and _int_arg(a["count"]) >= 0:
            count = min(count, _int_arg(a["count"]))
        budget.check_size(len(s) + count * (len(new) - len(old)), "'replace'")
    elif name == "format":
        _check_format(str(a.get("value", "")), list(a.get("args", ())) + list(a.get("kwargs", {}).values()))
    elif name in ("batch", "slice"):
        count = _int_arg(a.get("linecount" if name == "batch" else "slices"))
        if count > MAX_RANGE:
            raise TemplateBoundExceeded(f"'{name}' of {count} exceeds the chat template bound of {MAX_RANGE}")


_SERIALIZING_FILTERS = frozenset({"tojson", "string", "pprint", "xmlattr", "urlencode", "urlize", "e",
                                  "escape", "forceescape", "list", "format", "indent", "center", "wordwrap",
                                  "replace", "batch", "slice"})
"""Filters whose result grows with their whole input (walked and weighed first); the others (``length``,
``selectattr``, ``first`` ...) only have their result checked."""


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` with a deadline check, its size pre-check (``_precheck_filter``) and a size check of
    its result; keeps jinja2's ``pass_context`` / ``pass_environment`` marks."""
    try:
        signature: Optional[inspect.Signature] = inspect.signature(func)
    except (TypeError, ValueError):
        signature = None
    precheck = name in ("center", "indent", "wordwrap", "replace", "format", "batch", "slice")
    weigh_input = name in _SERIALIZING_FILTERS

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.tick()
        if weigh_input:
            cap = budget.limits.max_output_chars
            budget.check_size(sum(_weight(a, cap) for a in (*args, *kwargs.values()) if _sized(a)),
                              f"the input of '{name}'")
        if precheck and signature is not None:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                pass   # the filter itself reports the bad call
            else:
                bound.apply_defaults()
                _precheck_filter(name, bound.arguments)
        return _check_value(func(*args, **kwargs), f"the result of '{name}'")

    return wrapper


@jinja2.pass_eval_context
def _join_filter(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
    """jinja2's ``join`` with a size pre-check (items materialized and measured first)."""
    items = list(value)
    if attribute is not None:
        getter = jinja2.filters.make_attrgetter(eval_ctx.environment, attribute)
        items = [getter(x) for x in items]
    _budget().check_size(sum(_chars(x) for x in items) + len(str(d)) * max(len(items) - 1, 0), "'join'")
    return jinja2.filters.do_join(eval_ctx, items, d)


@jinja2.pass_environment
def _sum_filter(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """jinja2's ``sum`` with the deadline and size checked at every step (summing lists is quadratic)."""
    if attribute is not None:
        getter = jinja2.filters.make_attrgetter(environment, attribute)
        iterable = map(getter, iterable)
    budget = _budget()
    total = start
    for item in iterable:
        budget.tick()
        _check_binop("+", total, item)
        total = total + item
    return total


# ----------------------------------------------------------------------------------------
# The environment
# ----------------------------------------------------------------------------------------
class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateDict:
    """transformers' ``dict`` global: builds dicts, exposes no class internals."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return _check_value(dict(*args, **kwargs))

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return _check_value(dict.fromkeys(*args, **kwargs))


class _TemplateNamespace(jinja2.utils.Namespace):
    """transformers' ``namespace``: no underscore-prefixed attributes; here also no value beyond the
    size bound (a namespace carries values from one loop iteration to the next)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja2's Namespace signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name, value in attrs.items():
            _TemplateNamespace._check(name, value)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name, value)
        jinja2.utils.Namespace.__setitem__(self, name, value)
        _check_value(self, "a namespace")

    @staticmethod
    def _check(name: Any, value: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, but got "
                f"{name!r}.")
        _check_value(value, f"namespace attribute {name!r}")


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:  # noqa: A002 (transformers' name)
    return _check_value(datetime.now().strftime(format))


def _finalize(value: Any) -> Any:
    """Every ``{{ expression }}``'s value, before it is written out: a container whose text would be
    too long is refused before ``str()`` builds it."""
    return _check_value(value, "an expression's output")


class _BoundedCodeGenerator(CodeGenerator):
    """jinja2's code generator with every ``for`` loop's iterable wrapped in ``environment.bounded_iter``
    (a deadline check per item) and every ``~`` going through ``environment.bounded_join`` (a size
    check before joining)."""

    def visit_For(self, node: jinja2.nodes.For, frame: Frame) -> None:
        node.iter = jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute("bounded_iter"), [node.iter], [],
                                      None, None, lineno=node.lineno)
        super().visit_For(node, frame)

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile:
            func_name = "(markup_join if context.eval_ctx.volatile else str_join)"
        elif frame.eval_ctx.autoescape:
            func_name = "markup_join"
        else:
            func_name = "str_join"
        self.write(f"environment.bounded_join({func_name}, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandboxedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat template environment with the time and size bounds of the render in progress."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_GenerationTag, jinja2.ext.loopcontrols], finalize=_finalize)
        for name, func in list(self.filters.items()):
            self.filters[name] = _bounded_filter(name, func)
        self.filters["join"] = _bounded_filter("join", _join_filter)
        self.filters["sum"] = _bounded_filter("sum", _sum_filter)
        self.filters["tojson"] = _bounded_filter("tojson", _tojson)
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["dict"] = _TemplateDict()
        self.globals["namespace"] = _TemplateNamespace

    # Called by the compiled template code.
    def concat(self, parts: Iterable[str]) -> str:  # type: ignore[override]
        """Join a buffered block (a macro's or ``set`` block's output): size checked first."""
        parts = list(parts)
        _budget().check_size(sum(len(p) for p in parts), "a buffered block")
        return "".join(parts)

    def bounded_join(self, join: Callable[[Iterable[Any]], str], values: tuple) -> str:
        """``a ~ b``: size checked first."""
        _budget().check_size(sum(_chars(v) for v in values), "'~' concatenation")
        return join(values)

    def bounded_iter(self, iterable: Any) -> Iterator[Any]:
        """A ``for`` loop's items, with the deadline checked before each."""
        budget = _budget()
        for item in iterable:
            budget.tick()
            yield item

    # Sandbox interception points.
    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _budget().tick()
        _check_binop(operator, left, right)
        return _check_value(super().call_binop(context, operator, left, right), f"'{operator}'")

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        _budget().tick()
        if isinstance(getattr(obj, "__self__", None), str) and callable(obj):
            args = _check_str_method(obj, args, kwargs)
        return _check_value(super().call(context, obj, *args, **kwargs), "a call's result")

    def wrap_str_format(self, value: Any) -> Optional[Callable[..., str]]:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        @functools.wraps(wrapped)
        def checked(*args: Any, **kwargs: Any) -> str:
            values = list(args[0].values()) if is_map and args and isinstance(args[0], Mapping) else \
                list(args) + list(kwargs.values())
            _check_format(fmt, values)
            return wrapped(*args, **kwargs)

        return checked


_ENVIRONMENT = BoundedSandboxedEnvironment()
_JINJA2_VERSION = tuple(int(part) for part in re.findall(r"\d+", jinja2.__version__)[:3])
_compile_cache: dict[str, jinja2.Template] = {}
_compile_cache_lock = threading.Lock()


def compile_template(text: str, max_cached: int = TemplateLimits.max_cached_templates) -> jinja2.Template:
    """The compiled template of ``text`` (from a bounded LRU keyed by the text).

    Raises:
        jinja2.TemplateSyntaxError: it does not compile.
        ImportError: jinja2 is older than 3.1.6 (its sandbox has known escapes).
    """
    if _JINJA2_VERSION < (3, 1, 6):
        raise ImportError(f"Chat templates need jinja2>=3.1.6 (older sandboxes have known escapes), found "
                          f"{jinja2.__version__}; run `pip install -U 'jinja2>=3.1.6'`.")
    with _compile_cache_lock:
        template = _compile_cache.pop(text, None)
    if template is None:
        template = _ENVIRONMENT.from_string(text)
    with _compile_cache_lock:
        _compile_cache[text] = template          # most recently used last
        while len(_compile_cache) > max_cached:
            _compile_cache.pop(next(iter(_compile_cache)))
    return template


def check_template_syntax(text: str) -> None:
    """ValueError (naming the line) when ``text`` is not a template this renderer can compile."""
    try:
        compile_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not compile: {e.message} (line {e.lineno}).") from e


# ----------------------------------------------------------------------------------------
# Rendering a conversation
# ----------------------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """A fresh copy of ``value`` made of plain JSON types (transformers' ``_plain_template_data``):
    whatever the template sees has no methods beyond those of str, int, list and dict."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalize_messages(messages: list[Any]) -> list[dict]:
    """transformers' normalization: keys whose value is None dropped, reasoning copied under
    ``thinking`` and ``reasoning_content``."""
    out = []
    for message in _plain(messages):
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {type(message).__name__}.")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def select_template(template: Union[str, Mapping[str, str], None], tools: Any = None) -> Optional[str]:
    """A tokenizer's template may be a dict of named templates: ``tool_use`` when there are tools, else
    ``default`` (transformers' ``get_chat_template``)."""
    if not isinstance(template, Mapping):
        return template
    if tools is not None and "tool_use" in template:
        return template["tool_use"]
    if "default" in template:
        return template["default"]
    raise ValueError(f"the model has several chat templates and none named 'default' ({sorted(template)}); "
                     "pass --chat-template.")


def _continue_final_message(chat: list[dict], template: str) -> str:
    """Tag the final message's text (transformers' way); returns the text to find in the render."""
    field = "content"
    final = chat[-1].get(field)
    if final is None:
        raise ValueError('continue_final_message is set but the final message has no "content" to continue.')
    if field not in template:
        raise ValueError('continue_final_message is set to "content" but the chat template does not use it.')
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if isinstance(block, dict) and "text" in block:
                final = block["text"]
                block["text"] = block["text"] + CONTINUE_FINAL_MESSAGE_TAG
                return final
        raise ValueError("continue_final_message is set but the final message has no text to continue.")
    chat[-1][field] = final + CONTINUE_FINAL_MESSAGE_TAG
    return final


def _cut_at_final_message(rendered: str, final: str) -> str:
    tag = CONTINUE_FINAL_MESSAGE_TAG
    if str(final).strip() not in rendered or tag.strip() not in rendered:
        raise ValueError("continue_final_message is set but the final message does not appear in the "
                         "rendered chat (the chat template drops part of it).")
    at = rendered.rindex(tag.strip())
    if rendered[at:at + len(tag)] == tag:
        return rendered[:at]
    return rendered[:at].rstrip()


def render_chat_template(template: str, messages: list[Any], *, limits: TemplateLimits,
                         add_generation_prompt: bool = False, continue_final_message: bool = False,
                         special_tokens: Optional[Mapping[str, Any]] = None, from_request: bool = False,
                         **kwargs: Any) -> str:
    """Render ``messages`` through ``template`` as transformers' ``apply_chat_template(...,
    tokenize=False)`` does, within ``limits``.

    Args:
        template: the template text (never a path).
        messages: the conversation (dicts with ``role`` and ``content``).
        limits: the bounds of this render.
        add_generation_prompt / continue_final_message: as transformers'.
        special_tokens: the tokenizer's ``special_tokens_map`` (``bos_token``, ``eos_token`` ...),
            visible to the template; ``kwargs`` override them.
        from_request: the template came with the request: errors blame ``chat_template`` and the
            template text is bounded by ``limits.max_template_chars``; else they blame ``messages``.
        **kwargs: more template variables (``chat_template_kwargs``); ``tools`` and ``documents``
            as transformers'.

    Raises:
        ChatTemplateError: the template does not compile, raised, crossed a bound, or the messages are
            not a conversation it can render.
    """
    param = "chat_template" if from_request else "messages"
    if from_request and len(template) > limits.max_template_chars:
        raise ChatTemplateError(f"chat_template: the template is {len(template)} characters long, more than "
                                f"the {limits.max_template_chars} a request may send.", param="chat_template")
    budget = _Budget(limits)
    token = _current.set(budget)
    try:
        try:
            compiled = compile_template(template, limits.max_cached_templates)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e.message} (line {e.lineno}).",
                                    param=param) from e
        budget.tick()
        tools, documents = kwargs.pop("tools", None), kwargs.pop("documents", None)
        if documents is not None and not all(isinstance(d, dict) for d in documents):
            raise ChatTemplateError("documents must be a list of dicts with 'title' and 'text' keys.",
                                    param=param)
        context = {**_plain(dict(special_tokens or {})), **_plain(kwargs)}
        try:
            chat = _normalize_messages(messages)
            final = _continue_final_message(chat, template) if continue_final_message else None
        except (TypeError, ValueError) as e:
            raise ChatTemplateError(str(e), param="messages") from e
        context.update(messages=chat, tools=_plain(tools), documents=_plain(documents),
                       add_generation_prompt=add_generation_prompt)
        rendered = _render(compiled, context, budget)
        return _cut_at_final_message(rendered, final) if final is not None else rendered
    except TemplateBoundExceeded as e:
        raise ChatTemplateError(f"the chat template was stopped: {e}.", param=param) from None
    except ChatTemplateError:
        raise
    except ValueError as e:
        if "continue_final_message" in str(e):
            raise ChatTemplateError(str(e), param="messages") from e
        raise ChatTemplateError(f"the chat template could not render the messages: {e}", param=param) from e
    except RecursionError as e:
        raise ChatTemplateError("the chat template recursed too deeply.", param=param) from e
    except MemoryError as e:
        raise ChatTemplateError("the chat template ran out of memory.", param=param) from e
    except Exception as e:  # jinja2's TemplateError (raise_exception), TypeError, KeyError... of the template
        message = e.message if isinstance(e, jinja2.TemplateError) and e.message else str(e)
        raise ChatTemplateError(f"the chat template could not render the messages: {message}",
                                param=param) from e
    finally:
        _current.reset(token)


def _render(compiled: jinja2.Template, context: dict[str, Any], budget: _Budget) -> str:
    """Render chunk by chunk, with the deadline and the output size checked at every chunk."""
    chunks: list[str] = []
    total = 0
    for chunk in compiled.generate(**context):
        total += len(chunk)
        budget.check_size(total, "the rendered chat")
        budget.tick()
        chunks.append(chunk)
    return "".join(chunks)
