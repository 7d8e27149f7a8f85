"""Record classes for the planner and the runtime: fields declared as class annotations, as in a
dataclass, built without generating code.

Why not ``dataclasses``: on Python 3.12 each ``@dataclass`` compiles and ``exec``s five or six
generated methods when its module is imported. The nine records a new process needs for its
first GPU result cost 7.2 ms of the executor's 10 ms import on the H100 host (measured with
``notes/probes/warm_first.py``; the first result's target is 30 ms). A ``Record`` subclass gets
the same behaviour from generic methods: an ``__init__`` taking the fields by position or
keyword with their defaults, ``__post_init__``, ``__repr__``, equality over the compared
fields, and, for ``frozen=True``, a hash over them and no assignment to them.

    class Arg(Record, frozen=True):
        kind: str
        value: int = 0
        extras: dict = field(default_factory=dict)
"""

from __future__ import annotations

_MISSING = object()


class FrozenRecordError(AttributeError):
    """Assigning to (or deleting) a field of a frozen record."""


class Field:
    __slots__ = ("name", "default", "default_factory", "compare", "repr")

    def __init__(self, default=_MISSING, default_factory=_MISSING, compare=True, repr=True):
        if default is not _MISSING and default_factory is not _MISSING:
            raise ValueError("a field takes a default or a default_factory, not both")
        self.name = ""
        self.default, self.default_factory = default, default_factory
        self.compare, self.repr = compare, repr

    @property
    def required(self) -> bool:
        return self.default is _MISSING and self.default_factory is _MISSING

    def __repr__(self) -> str:
        return f"Field({self.name!r})"


def field(*, default=_MISSING, default_factory=_MISSING, compare=True, repr=True) -> Field:
    """A field's options, where a plain default does not say enough (as ``dataclasses.field``)."""
    return Field(default, default_factory, compare, repr)


class Record:
    """Base of the record classes; see the module's docstring."""

    __fields__: tuple[Field, ...] = ()
    __frozen__ = False

    def __init_subclass__(cls, frozen: bool = False, **options):
        super().__init_subclass__(**options)
        if any(issubclass(base, Record) and base is not Record for base in cls.__bases__):
            raise TypeError(f"{cls.__name__}: a record cannot extend another record")
        fields = []
        annotations = vars(cls).get("__annotations__")
        if annotations is None:  # Pythons that evaluate annotations lazily
            annotations = getattr(cls, "__annotations__", {})
        for name in annotations:
            declared = vars(cls).get(name, _MISSING)
            spec = declared if isinstance(declared, Field) else Field(default=declared)
            spec.name = name
            if isinstance(declared, Field):  # the default, if any, lives in the Field
                delattr(cls, name)
            if spec.required and fields and not fields[-1].required:
                message = f"{name!r} has no default but an earlier field has one"
                raise TypeError(f"{cls.__name__}: field {message}")
            fields.append(spec)
        cls.__fields__ = tuple(fields)
        cls.__frozen__ = frozen
        cls.__compared__ = tuple(spec.name for spec in fields if spec.compare)
        cls.__match_args__ = tuple(spec.name for spec in fields)
        # equal records hash alike; a mutable record is not hashable (as a dataclass with eq)
        cls.__hash__ = Record._hash_fields if frozen else None

    def __init__(self, *args, **kwargs):
        fields = self.__fields__
        name = type(self).__name__
        if len(args) > len(fields):
            raise TypeError(f"{name}() takes {len(fields)} arguments but {len(args)} were given")
        setter = object.__setattr__
        for index, spec in enumerate(fields):
            if index < len(args):
                if spec.name in kwargs:
                    raise TypeError(f"{name}() got multiple values for argument {spec.name!r}")
                value = args[index]
            elif spec.name in kwargs:
                value = kwargs.pop(spec.name)
            elif spec.default is not _MISSING:
                value = spec.default
            elif spec.default_factory is not _MISSING:
                value = spec.default_factory()
            else:
                raise TypeError(f"{name}() missing required argument {spec.name!r}")
            setter(self, spec.name, value)
        if kwargs:
            raise TypeError(f"{name}() got unexpected keyword arguments {sorted(kwargs)}")
        post_init = getattr(self, "__post_init__", None)
        if post_init is not None:
            post_init()

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{spec.name}={getattr(self, spec.name)!r}" for spec in self.__fields__ if spec.repr
        )
        return f"{type(self).__qualname__}({shown})"

    def _compared_values(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__compared__)

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return self is other or self._compared_values() == other._compared_values()

    def _hash_fields(self) -> int:
        return hash(self._compared_values())

    def __setattr__(self, name, value):
        if self.__frozen__:
            raise FrozenRecordError(f"cannot assign to field {name!r} of a frozen record")
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        if self.__frozen__:
            raise FrozenRecordError(f"cannot delete field {name!r} of a frozen record")
        object.__delattr__(self, name)


def fields(record) -> tuple[Field, ...]:
    """The fields of a record or record class, in declaration order."""
    return record.__fields__


def replace(record, **changes):
    """A new record of the same class: ``record``'s fields with ``changes`` (``__post_init__``
    runs again, as for ``dataclasses.replace``)."""
    values = {spec.name: getattr(record, spec.name) for spec in record.__fields__}
    unknown = set(changes) - set(values)
    if unknown:
        raise TypeError(f"{type(record).__name__} has no fields {sorted(unknown)}")
    values.update(changes)
    return type(record)(**values)
