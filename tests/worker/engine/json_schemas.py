"""JSON schemas for the constrained-decoding tests: nested objects, arrays, enums, required fields, numbers
with bounds, strings with patterns. Every string, array and integer is bounded, so a random-weight model
completes each schema within a small token budget; numbers with a fraction rely on sampling to stop."""

from __future__ import annotations

INT_0_99 = {"type": "integer", "minimum": 0, "maximum": 99}
WORD = {"type": "string", "pattern": "^[a-z]{1,6}$"}


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: dict[str, dict] = {
    "person": obj(
        {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}
    ),
    "classification": obj(
        {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        }
    ),
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    "nested_user": obj(
        {
            "user": obj(
                {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,5}\\.(com|org)$"},
                }
            )
        }
    ),
    "product": obj(
        {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
            "in_stock": {"type": "boolean"},
        }
    ),
    "date": obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
    "nullable": obj({"answer": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]}}),
    "entries": {
        "type": "array",
        "items": obj({"k": {"enum": ["a", "b"]}, "v": {"type": "integer", "minimum": -5, "maximum": 5}}),
        "maxItems": 2,
    },
    "matrix": {
        "type": "array",
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2},
        "maxItems": 2,
    },
    "boolean": {"type": "boolean"},
    "bounded_int": {"type": "integer", "minimum": -50, "maximum": 50},
    "string_enum": {"enum": ["alpha", "beta", "gamma"]},
    "const": obj({"version": {"const": 2}, "kind": {"const": "v"}}),
    "optional": obj(
        {"a": {"type": "string", "maxLength": 4}, "b": {"type": "string", "maxLength": 4}}, required=["a"]
    ),
    "order": obj(
        {
            "customer": obj(
                {
                    "name": WORD,
                    "address": obj({"city": WORD, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
                }
            ),
            "items": {
                "type": "array",
                "items": obj({"sku": WORD, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}),
                "minItems": 1,
                "maxItems": 2,
            },
        }
    ),
    "short_word": {"type": "string", "minLength": 2, "maxLength": 4, "pattern": "^[a-z]+$"},
    "unit_number": {"type": "number", "minimum": -1, "maximum": 1},
    "words": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
    "shape": {
        "anyOf": [
            obj({"circle": obj({"r": {"type": "integer", "minimum": 1, "maximum": 9}})}),
            obj({"square": obj({"side": {"type": "integer", "minimum": 1, "maximum": 9}})}),
        ]
    },
    "null": {"type": "null"},
    "flags": obj({f"f{i}": {"type": "boolean"} for i in range(5)}),
    "refs": {
        "$defs": {"pt": obj({"x": INT_0_99, "y": INT_0_99})},
        **obj({"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}),
    },
    "scores": obj(
        {"scores": {"type": "array", "items": INT_0_99, "minItems": 2, "maxItems": 4}, "best": INT_0_99}
    ),
}
