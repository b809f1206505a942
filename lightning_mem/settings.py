"""Settings errors that name the setting, and typed constraints checked once for every entry point.

The library names a bad setting relative to what it was given: a dataclass's field (``r``), a
function's argument. Where those settings sit in a config file is the caller's business: a recipe
wraps the call in :func:`settings_at` (``model.lora``) and the same error then names
``model.lora.r``. Someone importing the library into their own Lightning code, with another YAML
layout, sees field names, never our YAML paths.

Range rules are written once, as jsonargparse typed constraints on the annotation
(``r: PositiveInt``, ``lora_dropout: HalfOpenUnitInterval``, ``bias: Literal[...]``): LightningCLI
rejects a bad value while parsing, naming the full key, before any model is loaded; and a dataclass
built in Python checks the same annotations in ``__post_init__`` through :func:`check_fields`.
jsonargparse registers one type per rule (a second name for the same bounds is refused), so the
rules several modules share are defined here.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal, Union

from jsonargparse.typing import restricted_number_type

#: ``[0, 1)``: a dropout probability, or any fraction that may be 0 but not 1.
HalfOpenUnitInterval = restricted_number_type(
    "HalfOpenUnitInterval", float, [(">=", 0), ("<", 1)], docstring="float restricted to 0 <= v < 1"
)
#: ``(0, 1]``: a share that must be more than nothing and at most all (top-p, a memory fraction).
LeftOpenUnitInterval = restricted_number_type(
    "LeftOpenUnitInterval", float, [(">", 0), ("<=", 1)], docstring="float restricted to 0 < v <= 1"
)
#: A count of at least one (the same set as ``PositiveInt``, said as ``>= 1``).
AtLeastOne = restricted_number_type("AtLeastOne", int, (">=", 1), docstring="int restricted to be >=1")
#: A count of at least two (a GRPO group; a sequence's prompt and response tokens).
AtLeastTwo = restricted_number_type("AtLeastTwo", int, (">=", 2), docstring="int restricted to be >=2")


class SettingError(ValueError):
    """A bad setting, named relative to what the library was given.

    The message is ``<prefix><key>`` in backticks, then ``<problem>``; or ``problem`` alone where it
    names the key in backticks itself (``"set exactly one of `train_file` and `dataset`"``, ``"`name: vllm` ..."``).
    ``siblings`` are other settings next to ``key`` that ``problem`` names in backticks:
    :meth:`under` names them from the same prefix, so ``max_memory`` and ``device_map`` become
    ``model.max_memory`` and ``model.device_map`` together.
    """

    def __init__(self, key: str, problem: str, *, siblings: tuple[str, ...] = (), prefix: str = "") -> None:
        self.key, self.problem, self.siblings, self.prefix = key, problem, tuple(siblings), prefix
        # A name in backticks, alone or leading a snippet (`name`, `name: vllm`, `name=3`).
        names = "|".join(re.escape(name) for name in sorted({key, *self.siblings}, key=len, reverse=True))
        named = re.compile(rf"`({names})(?=[`:= ])")
        text = named.sub(lambda m: f"`{prefix}{m.group(1)}", problem)
        names_key = any(m.group(1) == key for m in named.finditer(problem))
        super().__init__(text if names_key else f"`{prefix}{key}`{text}")

    def under(self, prefix: str) -> SettingError:
        """The same error (same class) named from ``prefix`` (``r`` under ``model.lora``: ``model.lora.r``)."""
        outer = f"{prefix}.{self.prefix}" if prefix else self.prefix
        return type(self)(self.key, self.problem, siblings=self.siblings, prefix=outer)

    def __reduce__(self) -> tuple[Any, ...]:  # picklable, as errors crossing processes must be
        return (_rebuild, (type(self), self.key, self.problem, self.siblings, self.prefix))


def _rebuild(cls: type[SettingError], key: str, problem: str, siblings: tuple[str, ...], prefix: str) -> SettingError:
    return cls(key, problem, siblings=siblings, prefix=prefix)


class SettingPathError(SettingError, FileNotFoundError):
    """A path setting that names nothing on disk (a ``FileNotFoundError`` too)."""


class SettingNotSupported(SettingError, NotImplementedError):
    """A setting this code path cannot honour yet (a ``NotImplementedError`` too)."""


def join_key(*parts: str) -> str:
    """``join_key("data", "max_length")`` -> ``"data.max_length"``; empty parts are left out."""
    return ".".join(part for part in parts if part)


#: Where a Lightning strategy's arguments sit: the Trainer's ``strategy``, built from its
#: ``class_path`` and ``init_args`` (LightningCLI's layout, and ``Trainer(strategy=...)`` in Python).
STRATEGY_ARGS = "trainer.strategy.init_args"


def callback_key(callback: Any) -> str:
    """``trainer.callbacks[MemoryMonitor]``: a Lightning callback (an instance or a class), named by
    its class as a config lists it (its ``class_path``) among the Trainer's ``callbacks``.

    A callback is a Trainer argument wherever it is used (a YAML, ``Trainer(callbacks=[...])``), so
    its errors name it there: a problem with the callback as a whole names this key, one of its
    arguments ``<key>.init_args.<argument>`` (:func:`callback_args`)."""
    cls = callback if isinstance(callback, type) else type(callback)
    return f"trainer.callbacks[{cls.__name__}]"


def callback_args(callback: Any) -> str:
    """``trainer.callbacks[MemoryMonitor].init_args``: the prefix of a callback's arguments, for
    :func:`settings_at` around the checks that name them (``every_n_steps``)."""
    return f"{callback_key(callback)}.init_args"


def user_error_in(err: BaseException, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception of ``kinds`` in ``err`` and the exceptions it was raised from
    (``raise ... from``, its ``__cause__`` chain), or None.

    A library that calls a constructor or a hook may wrap what it raised: jsonargparse re-raises a
    callback's or a strategy's constructor error as "Does not validate against any of the Union
    subtypes", raised from the original. Only explicit causes are followed: an exception merely
    raised while another was being handled (``__context__``) is a new problem, not a wrapping."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, kinds):
            return current
        seen.add(id(current))
        current = current.__cause__
    return None


@contextmanager
def settings_at(prefix: str) -> Iterator[None]:
    """Re-raise a :class:`SettingError` from the block with its key under ``prefix``: how a recipe
    names its YAML path (``with settings_at("model.lora"): check_lora_targets(...)``). An empty
    prefix changes nothing."""
    if not prefix:
        yield
        return
    try:
        yield
    except SettingError as err:
        raise err.under(prefix) from None


# ---------------------------------------------------------------------------------------------
# Typed constraints, checked on values built in Python
# ---------------------------------------------------------------------------------------------


def _describe(restrictions: list[tuple[Any, Any]], join: str) -> str:
    """``positive``, ``>= 2``, ``in [0, 1)``: a restricted number type's rule in words."""
    ops = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
    bounds = {ops[op.__name__]: ref for op, ref in restrictions}
    if bounds == {">": 0}:
        return "positive"
    if join == "and" and len(bounds) == 2 and set(bounds) in ({">", "<"}, {">=", "<"}, {">", "<="}, {">=", "<="}):
        low, high = (">" if ">" in bounds else ">="), ("<" if "<" in bounds else "<=")
        return f"in {'(' if low == '>' else '['}{bounds[low]}, {bounds[high]}{')' if high == '<' else ']'}"
    return f" {join} ".join(f"{op} {ref}" for op, ref in bounds.items())


def _one_of(choices: tuple[Any, ...]) -> str:
    names = [repr(c) for c in choices]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def constraint_problem(annotation: Any, value: Any) -> str | None:
    """Why ``value`` breaks ``annotation`` (a jsonargparse restricted number type, a ``Literal``,
    ``bool``, or an optional one of these), as ``"must be ..."``; None when it does not, or when
    the annotation is not one of those (other types are left to the code that uses them)."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        problems = [constraint_problem(option, value) for option in options if option is not type(None)]
        if any(problem is None for problem in problems):
            return None
        return " or ".join(problems) + (" or null" if type(None) in options else "")
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value in choices and not (isinstance(value, bool) and not any(c is value for c in choices)):
            return None
        return f"must be {_one_of(choices)}"
    if annotation is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if not (isinstance(annotation, type) and issubclass(annotation, (int, float))) or annotation in (int, float):
        return None
    # restricted_number_type sets _restrictions, _type and _join on the class it makes (its
    # extra_attrs); they give the rule in words.
    restrictions = getattr(annotation, "_restrictions", None)
    if restrictions is None:  # a constrained number type of another make: its own check and words
        try:
            annotation(value)
        except (TypeError, ValueError) as err:
            return f"must be a {annotation.__name__} ({err})"
        return None
    base = annotation._type
    rule = _describe(restrictions, annotation._join)
    # Stricter than the parser on type: in Python an int setting given 5e8 is a mistake to name.
    kinds = (int,) if base is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        return f"must be {'an int' if base is int else 'a number'}, {rule}"
    try:
        annotation(value)
    except ValueError:
        return f"must be {rule}"
    return None


@functools.cache
def _hints(owner: Any) -> dict[str, Any]:
    return typing.get_type_hints(owner)


def field_problems(obj: Any) -> Iterator[tuple[str, Any, str]]:
    """``(field, value, problem)`` for each dataclass field whose value breaks its annotation."""
    hints = _hints(type(obj))
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        problem = constraint_problem(hints.get(field.name), value)
        if problem is not None:
            yield field.name, value, problem


def check_arguments(function: Any, values: dict[str, Any]) -> None:
    """:func:`check_fields` for a constructor's arguments: raise a :class:`SettingError` naming the
    first of ``values`` that breaks its annotation in ``function``'s signature (the rule the CLI
    applies while parsing, for a class built in Python)."""
    hints = _hints(function)
    for name, value in values.items():
        problem = constraint_problem(hints.get(name), value)
        if problem is not None:
            raise SettingError(name, f" {problem}, got {value!r}")


def check_fields(obj: Any) -> None:
    """Raise a :class:`SettingError` naming the first field of dataclass ``obj`` whose value breaks
    its typed constraint: a ``__post_init__`` calls this so that Python gets the parser's rule.

    Numbers the parser built as its constraint classes (a ``PositiveInt`` is an ``int`` subclass)
    are stored back as plain ``int``/``float``: a checkpoint or a YAML dump then holds builtins only
    (``torch.load(weights_only=True)`` refuses any other class).
    """
    for name, value, problem in field_problems(obj):
        raise SettingError(name, f" {problem}, got {value!r}")
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if isinstance(value, (int, float)) and type(value) not in (int, float, bool):
            object.__setattr__(obj, field.name, float(value) if isinstance(value, float) else int(value))
