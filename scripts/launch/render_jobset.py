"""Prints scripts/launch/jobset.yaml resized and filled in, ready for `kubectl apply -f -`.

    python scripts/launch/render_jobset.py --nodes 16 --image REGISTRY/jaxtrain:TAG --config configs/x.py \
        [--gpus-per-node 8 | --gpus-per-node 0 | --tpu-topology 4x4x4 --tpu-accelerator tpu-v5p-slice] \
        [--name run1] [--workdir /workdir/run1] [--claim jaxtrain-workdir] [--max-restarts 3] \
        [-- --config.train.steps=1000 ...]

jobset.yaml stays the one template: this script loads it and sets only the fields that depend on the
size, the image, the accelerator and the command. Comments are not carried over.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import yaml

TEMPLATE = Path(__file__).with_name("jobset.yaml")
GPU_LABEL = "cloud.google.com/gke-accelerator"
TPU_LABELS = ("cloud.google.com/gke-tpu-accelerator", "cloud.google.com/gke-tpu-topology")
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, required=True, help="trainer pods, one per node")
    p.add_argument("--image", required=True, help="container image holding jaxtrain, run from the repo root")
    p.add_argument("--config", default="configs/default.py")
    p.add_argument("--name", default="jaxtrain", help="JobSet name (also the pods' DNS subdomain)")
    p.add_argument("--workdir", help="--config.workdir inside the pod (default /workdir/<name>, on the claim)")
    p.add_argument("--claim", help="ReadWriteMany PersistentVolumeClaim mounted at /workdir")
    p.add_argument("--max-restarts", type=int, help="restarts after failures other than preemption")
    acc = p.add_mutually_exclusive_group()
    acc.add_argument("--gpus-per-node", type=int, help="GPUs per pod; 0 = CPU pods (template: 8)")
    acc.add_argument("--tpu-topology", help="TPU slice topology, e.g. 2x2x2; chips per pod = chips / nodes")
    p.add_argument("--gpu-type", help=f"node selector {GPU_LABEL} (template: nvidia-h100-80gb)")
    p.add_argument("--tpu-accelerator", default="tpu-v5p-slice", help=f"node selector {TPU_LABELS[0]}")
    p.add_argument("args", nargs="*", help="extra flags for jaxtrain.main, after --")
    a = p.parse_args(argv)
    if a.nodes < 1:
        p.error(f"--nodes: must be >= 1, got {a.nodes}")
    if not DNS_LABEL.fullmatch(a.name):
        p.error(f"--name: must be a DNS label (lowercase letters, digits, '-'), got {a.name!r}")
    if a.gpus_per_node is not None and a.gpus_per_node < 0:
        p.error(f"--gpus-per-node: must be >= 0, got {a.gpus_per_node}")
    return p, a


def render(argv) -> dict:
    p, a = _parse(argv)
    doc = yaml.safe_load(TEMPLATE.read_text())
    doc["metadata"]["name"] = a.name
    if doc["spec"].get("network", {}).get("subdomain") not in (None, a.name):
        p.error("jobset.yaml sets network.subdomain: jaxtrain's coordinator name assumes the JobSet name")
    if a.max_restarts is not None:
        doc["spec"]["failurePolicy"]["maxRestarts"] = a.max_restarts
    (rjob,) = doc["spec"]["replicatedJobs"]  # one replicated job: the trainers
    job = rjob["template"]["spec"]
    job["parallelism"] = job["completions"] = a.nodes
    # Pod hostnames are <jobset>-<replicated job>-<job index>-<pod index>: a DNS label (<= 63 chars).
    last = f"{a.name}-{rjob['name']}-{rjob['replicas'] - 1}-{a.nodes - 1}"
    if len(last) > 63:
        p.error(f"--name: pod hostname {last!r} would exceed 63 characters; use a shorter name")
    pod = job["template"]["spec"]
    (box,) = pod["containers"]
    box["image"] = a.image

    mount = next(m["mountPath"] for m in box["volumeMounts"] if m["name"] == "workdir")
    workdir = a.workdir or f"{mount}/{a.name}"
    box["command"] = ["python", "-m", "jaxtrain.main", "--config", a.config, f"--config.workdir={workdir}", *a.args]
    if a.claim:
        next(v for v in pod["volumes"] if v["name"] == "workdir")["persistentVolumeClaim"]["claimName"] = a.claim

    env = {e["name"]: e for e in box["env"]}
    env["JAXTRAIN_NUM_PROCESSES"]["value"] = str(a.nodes * rjob["replicas"])

    limits = box.setdefault("resources", {}).setdefault("limits", {})
    selector = pod.setdefault("nodeSelector", {})
    if a.tpu_topology:
        dims = a.tpu_topology.split("x")
        if not all(d.isdigit() and int(d) > 0 for d in dims):
            p.error(f"--tpu-topology: expected e.g. 2x2x2, got {a.tpu_topology!r}")
        chips = math.prod(int(d) for d in dims)
        if chips % a.nodes:
            p.error(f"--tpu-topology: {chips} chips do not split evenly over {a.nodes} nodes")
        limits.pop("nvidia.com/gpu", None)
        selector.pop(GPU_LABEL, None)
        limits["google.com/tpu"] = chips // a.nodes
        selector.update(dict(zip(TPU_LABELS, (a.tpu_accelerator, a.tpu_topology))))
    elif a.gpus_per_node == 0:
        limits.pop("nvidia.com/gpu", None)
        selector.pop(GPU_LABEL, None)
    else:
        if a.gpus_per_node:
            limits["nvidia.com/gpu"] = a.gpus_per_node
        if a.gpu_type:
            selector[GPU_LABEL] = a.gpu_type
    if not limits:  # CPU pods: no empty maps left behind
        box["resources"].pop("limits")
        if not box["resources"]:
            box.pop("resources")
    if not selector:
        pod.pop("nodeSelector")
    return doc


def main(argv=None) -> int:
    doc = render(sys.argv[1:] if argv is None else argv)
    sys.stdout.write(yaml.safe_dump(doc, sort_keys=False, width=120))
    return 0


if __name__ == "__main__":
    sys.exit(main())
