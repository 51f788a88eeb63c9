"""Write leaderworkerset-v1.json from the LeaderWorkerSet CRD (kubernetes-sigs/lws,
config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml, Apache-2.0).

The CRD's openAPIV3Schema inlines a whole PodTemplateSpec twice (about 600 kB); here the pod
templates and volume claim templates refer to Kubernetes' own definitions instead (the ones
kubernetes-validate ships, which tests/unit/test_deploy_manifests.py puts beside this schema),
descriptions are dropped, and every LWS object is closed (additionalProperties: false), as the API
server's strict field validation treats unknown fields. `status` is left out: manifests do not set it.

    python deploy/schemas/trim_lws_crd.py path/to/leaderworkerset.x-k8s.io_leaderworkersets.yaml "lws@COMMIT"
"""
from __future__ import annotations

import json
import os
import sys

import yaml

K8S = "https://kubernetes.io/api/_definitions.json#/$defs/"
REFS = {"leaderTemplate": K8S + "io.k8s.api.core.v1.PodTemplateSpec",
        "workerTemplate": K8S + "io.k8s.api.core.v1.PodTemplateSpec",
        "metadata": K8S + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}


def trim(node: dict) -> dict:
    out = {}
    for k, v in node.items():
        if k == "description" or k.startswith("x-kubernetes-") and k != "x-kubernetes-int-or-string":
            continue
        if k == "properties":
            props = {}
            for name, sub in v.items():
                if name == "status":
                    continue
                if name in REFS:
                    props[name] = {"$ref": REFS[name]}
                elif name == "volumeClaimTemplates":
                    props[name] = {"type": "array", "items": {"$ref": K8S + "io.k8s.api.core.v1.PersistentVolumeClaim"}}
                else:
                    props[name] = trim(sub)
            out[k] = props
        elif isinstance(v, dict):
            out[k] = trim(v)
        else:
            out[k] = v
    if out.get("x-kubernetes-int-or-string"):
        out.pop("x-kubernetes-int-or-string")
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.get("type") == "object" and "properties" in out:
        out["additionalProperties"] = False
    return out


def main(crd_path: str, source: str) -> None:
    with open(crd_path) as f:
        crd = yaml.safe_load(f)
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = trim(v1["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"type": "string", "enum": ["leaderworkerset.x-k8s.io/v1"]}
    schema["properties"]["kind"] = {"type": "string", "enum": ["LeaderWorkerSet"]}
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema",
              "$comment": f"LeaderWorkerSet v1 (leaderworkerset.x-k8s.io), trimmed by trim_lws_crd.py from {source}",
              **schema}
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "leaderworkerset-v1.json")
    with open(out, "w") as f:
        json.dump(schema, f, indent=1, sort_keys=True)
        f.write("\n")
    print(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "the lws CRD")
