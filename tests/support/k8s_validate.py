"""Offline checks of exported Kubernetes objects, as the API server would make them:

- a CRD's openAPIV3Schema (jsonschema) AND its CEL rules (``x-kubernetes-validations``,
  evaluated with cel-python: ``self`` bound to the value at the rule's place; transition
  rules, which use ``oldSelf``, are skipped: a new object has no old self);
- a pod template against the core API (kubernetes-validate, strict: unknown fields fail),
  plus the names it cannot check: containers, volumes (DNS-1123 labels), ports (IANA
  service names).
CRDs: tests/data/k8s-crds (copies of /work/shared/k8s-crds, see its README)."""

from __future__ import annotations

import re
from pathlib import Path

import celpy
import jsonschema
import yaml

CRDS = Path(__file__).parents[1] / "data" / "k8s-crds"
DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
PORT_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]([a-z0-9-]*[a-z0-9])?$")


class CRD:
    def __init__(self, file: str):
        crd = yaml.safe_load((CRDS / file).read_text())
        self.schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        self.validator = jsonschema.Draft7Validator(self.schema)
        self.env = celpy.Environment()
        self.rules = 0

    def errors(self, obj: dict) -> list[str]:
        out = [f"{list(e.path)}: {e.message}" for e in self.validator.iter_errors(obj)]
        self._cel(self.schema, obj, "", out)
        return sorted(out)

    def _cel(self, schema: dict, value, path: str, out: list[str]) -> None:
        for v in schema.get("x-kubernetes-validations") or []:
            if "oldSelf" in v["rule"]:
                continue
            self.rules += 1
            program = self.env.program(self.env.compile(v["rule"]))
            result = program.evaluate({"self": celpy.json_to_cel(value)})
            if result is not True and not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
                out.append(f"{path or '/'}: CEL {v['rule']!r}: {v.get('message', '')}")
        if isinstance(value, dict):
            for key, child in value.items():
                sub = (schema.get("properties") or {}).get(key)
                if sub is None and isinstance(schema.get("additionalProperties"), dict):
                    sub = schema["additionalProperties"]
                if sub is not None:
                    self._cel(sub, child, f"{path}/{key}", out)
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for i, child in enumerate(value):
                self._cel(schema["items"], child, f"{path}[{i}]", out)


def pod_spec_errors(spec: dict) -> list[str]:
    """A pod spec as the core API validates it, and the names it does not check."""
    import kubernetes_validate

    out = []
    template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"},
                "template": {"spec": spec}}
    try:
        kubernetes_validate.validate(template, kubernetes_validate.latest_version(), strict=True)
    except kubernetes_validate.ValidationError as exc:
        out.append(f"core API: {exc}")
    for c in spec.get("containers", []):
        if not DNS_1123_LABEL.match(c["name"]):
            out.append(f"container name {c['name']!r}")
        for p in c.get("ports", []):
            if "name" in p and not (PORT_NAME.match(p["name"]) and len(p["name"]) <= 15):
                out.append(f"port name {p['name']!r}")
        for m in c.get("volumeMounts", []):
            if m["name"] not in {v["name"] for v in spec.get("volumes", [])}:
                out.append(f"mount of unknown volume {m['name']!r}")
    for v in spec.get("volumes", []):
        if not (DNS_1123_LABEL.match(v["name"]) and len(v["name"]) <= 63):
            out.append(f"volume name {v['name']!r}")
    return out
