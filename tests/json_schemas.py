"""JSON schemas as client libraries send them, for the structured-output tests.

Each covers features a pydantic model (what LangChain's ``with_structured_output`` and
instructor send) or a hand-written OpenAI ``strict`` schema uses: string length and
pattern bounds, enums and consts, numbers with bounds, arrays with item counts, nested
objects and ``$ref``, optional and nullable fields, ``anyOf`` and a discriminated
``oneOf``, formats. The unit test walks the grammar of each at random; the end-to-end
test decodes under each with the CPU engine. Both validate with ``jsonschema``.
"""

from __future__ import annotations

import datetime
import json
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as OpenAI's strict mode asks


class Profile(_Strict):
    """The issue's model: two strings, one with a maximum length (23 of 30 answers did not parse)."""

    name: str = Field(max_length=12)
    bio: str


class Address(_Strict):
    street: Annotated[str, Field(min_length=1, max_length=20)]
    postcode: Annotated[str, Field(pattern=r"^[0-9]{5}$")]


class Order(_Strict):
    """Nested objects ($ref), numbers with bounds, an array with item counts, optional and nullable fields."""

    quantity: int = Field(ge=1, le=99)
    price: float = Field(gt=0, lt=1000)
    tags: list[Annotated[str, Field(max_length=8)]] = Field(min_length=1, max_length=3)
    ship_to: Address
    note: str | None = Field(default=None, max_length=10)
    status: Literal["new", "paid", "shipped"]


class Cat(_Strict):
    kind: Literal["cat"]
    lives: int = Field(ge=0, le=9)


class Dog(_Strict):
    kind: Literal["dog"]
    name: str = Field(min_length=1, max_length=6)


class Pet(_Strict):
    """A discriminated union: pydantic writes ``oneOf`` with a ``discriminator``."""

    pet: Cat | Dog = Field(discriminator="kind")


class Event(_Strict):
    """Formats pydantic writes for dates and ids."""

    day: datetime.date
    id: Annotated[str, Field(json_schema_extra={"format": "uuid"})]


def _object(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


SCHEMAS: dict[str, dict[str, Any]] = {
    "profile": Profile.model_json_schema(),
    "order": Order.model_json_schema(),
    "pet": Pet.model_json_schema(),
    "event": Event.model_json_schema(),
    "lengths": _object(
        code={"type": "string", "minLength": 2, "maxLength": 5}, word={"type": "string", "maxLength": 3}
    ),
    "pattern_and_length": _object(slug={"type": "string", "pattern": "^[a-z-]+$", "maxLength": 6}),
    "enum_const": _object(colour={"enum": ["red", "green", "blue"]}, version={"const": 2}),
    "numbers": _object(
        small={"type": "integer", "minimum": -3, "maximum": 3},
        ratio={"type": "number", "exclusiveMinimum": 0, "maximum": 1.5},
        step={"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50},
    ),
    "any_of": _object(value={"anyOf": [{"type": "string", "maxLength": 4}, {"type": "integer"}, {"type": "null"}]}),
    "array_counts": _object(
        points={
            "type": "array",
            "items": _object(x={"type": "integer", "minimum": 0, "maximum": 9}, y={"type": "boolean"}),
            "minItems": 2,
            "maxItems": 3,
        }
    ),
}

# Keywords the grammar engine cannot enforce: a request with one is refused with a 400 naming it.
UNENFORCEABLE: dict[str, dict[str, Any]] = {
    "uniqueItems": _object(ids={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
    "not": _object(value={"not": {"type": "string"}}),
    "oneOf": _object(value={"oneOf": [{"type": "integer"}, {"type": "number"}]}),  # overlapping branches
    "format": _object(colour={"type": "string", "format": "color"}),
}


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON (RFC 8259)")


def parse_and_check(text: str, schema: dict[str, Any]) -> Any:
    """Parse ``text`` as strict JSON and check it against ``schema``, formats included (as pydantic
    would parse them); raise on either failure, else return the value."""
    instance = json.loads(text, parse_constant=_not_json)  # Python alone would take NaN and Infinity
    jsonschema.validate(instance, schema, format_checker=jsonschema.FormatChecker())
    return instance
