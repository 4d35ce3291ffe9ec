"""A result held as a few frozen records, one per kind of number, that still reads and builds
by its flat field names. :class:`~memfit.levers.recipe.Recipe` keeps what fit decided, what
it predicted, what it measured and where it came from apart, so that a reader sees which
number is which; the names it had when it was one flat record (``recipe.levers``,
``recipe.predicted_peak_bytes``, ``Recipe(budget_bytes=..., levers=..., ...)`` and its JSON)
keep working, because users' scripts and saved files use them."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar


class Sectioned:
    """Base of a dataclass whose fields are frozen records (:attr:`RECORDS`, attribute name ->
    record class). Each record's fields read as the whole's attributes, and set as them by
    replacing the record; the whole is built from its records, or from the flat fields by name
    or in :attr:`FLAT`'s order (the order of the single flat record it once was, which its
    JSON keeps)."""

    RECORDS: ClassVar[dict[str, type]]
    FLAT: ClassVar[tuple[str, ...]]
    WHERE: ClassVar[dict[str, str]]
    """Flat field name -> the attribute of the record holding it."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "RECORDS" not in cls.__dict__:  # a base that names no records itself (FitRecipe)
            return
        cls.WHERE = {f.name: attr for attr, record in cls.RECORDS.items() for f in dataclasses.fields(record)}
        if sorted(cls.WHERE) != sorted(cls.FLAT):  # a record's field missing from FLAT would not be saved
            raise TypeError(f"{cls.__name__}.FLAT must name every field of its records once")
        for name, attr in cls.WHERE.items():
            if name not in cls.__dict__:  # a name the class defines itself stays its own
                setattr(cls, name, _flat_property(cls.__name__, name, attr))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for attr, record in _records(type(self), args, kwargs).items():
            object.__setattr__(self, attr, record)

    def __setattr__(self, name: str, value: Any) -> None:
        # The records are frozen: a field set by its flat name (``recipe.budget = "6GiB"``, as
        # scripts did when the recipe was one flat record) replaces the record holding it.
        if name in self.WHERE:
            attr = self.WHERE[name]
            object.__setattr__(self, attr, dataclasses.replace(getattr(self, attr), **{name: value}))
        elif name in self.RECORDS and isinstance(value, self.RECORDS[name]):
            object.__setattr__(self, name, value)
        else:
            raise AttributeError(f"{type(self).__name__} has no field {name!r} to set; {_fields_are(type(self))}")

    def flat(self) -> dict[str, Any]:
        """Every field by its flat name, in :attr:`FLAT` order."""
        return {name: getattr(self, name) for name in self.FLAT}


def _flat_property(owner: str, name: str, attr: str) -> property:
    def read(self: Any) -> Any:
        return getattr(getattr(self, attr), name)

    return property(read, doc=f"``{owner}.{attr}.{name}``, read here by its flat name.")


def _fields_are(cls: type) -> str:
    return f"its records are {', '.join(cls.RECORDS)} and its fields {', '.join(cls.FLAT)}"


def _records(cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The records of a ``cls(...)`` call: given whole (by position or by name; flat fields
    named beside them change them, as ``dataclasses.replace(recipe, budget=...)`` does), or
    sorted out of the flat fields."""
    kinds = cls.RECORDS
    if (args and isinstance(args[0], next(iter(kinds.values())))) or any(name in kinds for name in kwargs):
        given = {**dict(zip(kinds, args)), **{k: v for k, v in kwargs.items() if k in kinds}}
        wrong = [attr for attr, record in kinds.items() if not isinstance(given.get(attr), record)]
        if len(args) > len(kinds) or wrong:
            names = ", ".join(f"{attr}: {record.__name__}" for attr, record in kinds.items())
            raise TypeError(
                f"{cls.__name__}() takes its records ({names}); {', '.join(wrong) or 'more'} missing or of another type"
            )
        for name, value in kwargs.items():
            if name not in kinds:
                if name not in cls.WHERE:
                    raise TypeError(f"{cls.__name__}() has no field {name!r}; {_fields_are(cls)}")
                where = cls.WHERE[name]
                given[where] = dataclasses.replace(given[where], **{name: value})
        return given
    if len(args) > len(cls.FLAT):
        raise TypeError(f"{cls.__name__}() takes at most {len(cls.FLAT)} fields by position, got {len(args)}")
    flat = dict(zip(cls.FLAT, args))
    for name, value in kwargs.items():
        if name in flat:
            raise TypeError(f"{cls.__name__}() got {name!r} twice, by position and by name")
        if name not in cls.WHERE:
            raise TypeError(f"{cls.__name__}() has no field {name!r}; {_fields_are(cls)}")
        flat[name] = value
    return {
        attr: record(**{f.name: flat[f.name] for f in dataclasses.fields(record) if f.name in flat})
        for attr, record in kinds.items()
    }
