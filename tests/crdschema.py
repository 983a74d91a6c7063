"""A CustomResourceDefinition's schema as the API server applies it: structure, strict fields, CEL rules.

`strict` turns a CRD's OpenAPI v3 schema into a JSON schema that refuses the
fields it does not name (as `kubectl apply --validate=strict` and the API
server's strict field validation do); `validate` checks an object, and on an
update also the schema's `x-kubernetes-validations` rules (CEL, evaluated with
cel-python: `self`, and `oldSelf` for transition rules).
"""

from __future__ import annotations

import warnings
from typing import Any

import jsonschema

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # its date libraries, on newer Pythons
    import celpy
    import celpy.celtypes


def strict(schema: Any) -> Any:
    """An OpenAPI v3 schema of a CRD as a JSON schema that refuses fields it does not name."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    if schema.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if "properties" in out:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in out and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


class CrdSchema:
    """One version's openAPIV3Schema of a CRD: `errors(new, old)` lists what the API server would refuse."""

    def __init__(self, crd: dict[str, Any], version: str) -> None:
        [ver] = [v for v in crd["spec"]["versions"] if v["name"] == version]
        self.schema = ver["schema"]["openAPIV3Schema"]
        checked = strict(self.schema)
        checked["properties"]["metadata"] = {"type": "object"}  # the API server's own ObjectMeta checks
        self.validator = jsonschema.Draft7Validator(checked)
        self.env = celpy.Environment()

    def errors(self, new: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
        found = [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
                 for e in self.validator.iter_errors(new)]
        return found + self._rules(self.schema, new, old, "")

    def _rules(self, schema: dict[str, Any], new: Any, old: Any, where: str) -> list[str]:
        out: list[str] = []
        for rule in schema.get("x-kubernetes-validations") or []:
            if "oldSelf" in rule["rule"] and old is None:
                continue  # a transition rule: only on update, where there was a value
            program = self.env.program(self.env.compile(rule["rule"]))
            bindings = {"self": celpy.json_to_cel(new)}
            if old is not None:
                bindings["oldSelf"] = celpy.json_to_cel(old)
            verdict = program.evaluate(bindings)
            if not (isinstance(verdict, celpy.celtypes.BoolType) and bool(verdict)):
                out.append(f"{where or '<root>'}: {rule.get('message') or rule['rule']}")
        if isinstance(new, dict):
            for key, sub in (schema.get("properties") or {}).items():
                if key in new:
                    out += self._rules(sub, new[key], old.get(key) if isinstance(old, dict) else None,
                                       f"{where}.{key}".lstrip("."))
        return out
