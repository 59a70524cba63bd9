"""Custom resources validated against their own published CRDs, offline.

tests/deploy/crds/ holds the upstream CustomResourceDefinitions verbatim (README.md
there says from which release). Each served version's openAPIV3Schema is checked as
a JSON schema (jsonschema, Draft 7: the OpenAPI v3 subset that structural schemas
use), made strict the way `kubectl apply` (field validation Strict) treats a custom
resource: an object schema that lists its properties admits no other field, unless
the CRD says x-kubernetes-preserve-unknown-fields.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

CRDS = Path(__file__).resolve().parent / "crds"


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    schema = copy.copy(schema)
    if "pattern" in schema:
        # Go's RE2 takes an inline flag anywhere ("^(?i)(abort|warn)?$"); Python only
        # at the start. The same language either way.
        pattern = schema["pattern"]
        if pattern.startswith("^(?i)"):
            schema["pattern"] = "(?i)^" + pattern.removeprefix("^(?i)")
    if "properties" in schema:
        schema["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            schema["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            schema[key] = _strict(schema[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in schema:
            schema[key] = [_strict(s) for s in schema[key]]
    return schema


@cache
def crd_validators() -> dict[tuple[str, str], jsonschema.Draft7Validator]:
    """(apiVersion, kind) -> a strict validator, for every served version."""
    validators = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        assert crd["kind"] == "CustomResourceDefinition", path
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version["served"]:
                schema = _strict(version["schema"]["openAPIV3Schema"])
                jsonschema.Draft7Validator.check_schema(schema)
                validators[(f"{group}/{version['name']}", kind)] = jsonschema.Draft7Validator(
                    schema
                )
    return validators


def crd_errors(obj: dict[str, Any]) -> list[str]:
    """What the object's CRD schema rejects: empty when it is valid."""
    validator = crd_validators().get((obj["apiVersion"], obj["kind"]))
    if validator is None:
        return [f"no CRD in tests/deploy/crds serves {obj['apiVersion']} {obj['kind']}"]
    return [
        f"{'.'.join(str(p) for p in error.absolute_path) or '(root)'}: {error.message}"
        for error in validator.iter_errors(obj)
    ]
