"""The Kubernetes manifests in docs/kubernetes/, checked offline.

No cluster here: the manifests are parsed, their pod templates are checked
against Kubernetes's own schema (kubernetes-validate, strict: an unknown
field fails), and the `TF_CONFIG` every replica would get is built as the
engine builds it (the Kubeflow training operator for a TFJob; the pod's own
command for the Trainer v2 TrainJob, executed here) and replayed through
`keras_dist.cluster.parse_tf_config` and `auto_strategy`'s decision.
"""

import json
import os

import pytest
import yaml
from helpers import REPO_ROOT

from keras_dist import cluster
from keras_dist.strategy import describe_choice

MANIFESTS = REPO_ROOT / "docs" / "kubernetes"
IN_A_POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}
# The fields of a Trainer v2 TrainJob's `spec.trainer` (its CRD, v1alpha1).
TRAINER_FIELDS = {
    "image",
    "command",
    "args",
    "env",
    "numNodes",
    "resourcesPerNode",
    "numProcPerNode",
}


def load(name):
    with open(MANIFESTS / name) as handle:
        return list(yaml.safe_load_all(handle))


def operator_tf_config(job, replica_type, index, namespace="default"):
    """The TF_CONFIG the training operator gives one TFJob replica.

    Each replica type's pods are `<job>-<type>-<index>` behind a service of
    the same name; the port is the container's `tfjob-port`.
    """
    cluster_spec = {}
    for kind, spec in job["spec"]["tfReplicaSpecs"].items():
        (container,) = spec["template"]["spec"]["containers"]
        (port,) = [
            p["containerPort"] for p in container["ports"] if p["name"] == "tfjob-port"
        ]
        name = job["metadata"]["name"]
        cluster_spec[kind.lower()] = [
            f"{name}-{kind.lower()}-{i}.{namespace}.svc:{port}"
            for i in range(spec["replicas"])
        ]
    return json.dumps(
        {
            "cluster": cluster_spec,
            "task": {"type": replica_type.lower(), "index": index},
            "environment": "cloud",
        }
    )


def pod_templates(document):
    """(where, pod template) for every pod template in a manifest document."""
    if document["kind"] == "TFJob":
        for kind, spec in document["spec"]["tfReplicaSpecs"].items():
            yield kind, spec["template"]
    elif document["kind"] == "TrainingRuntime":
        for job in document["spec"]["template"]["spec"]["replicatedJobs"]:
            yield job["name"], job["template"]["spec"]["template"]


ALL = [
    (name, index, document)
    for name in ("tfjob.yaml", "tfjob-ps.yaml", "trainjob.yaml")
    for index, document in enumerate(load(name))
]


@pytest.mark.parametrize(
    "name, index, document", ALL, ids=[f"{n}-{i}" for n, i, _ in ALL]
)
def test_pod_templates_pass_the_kubernetes_schema(name, index, document):
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed"
    )
    version = kubernetes_validate.latest_version()
    for where, template in pod_templates(document):
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"{document['metadata']['name']}-{where.lower()}"},
            "template": template,
        }
        try:
            kubernetes_validate.validate(pod_template, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{name} {where}: {error.message}")


@pytest.mark.parametrize("name", ["tfjob.yaml", "tfjob-ps.yaml"])
def test_tfjob_replicas_restart_on_failure(name):
    (job,) = load(name)
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "TFJob"
    for kind, spec in job["spec"]["tfReplicaSpecs"].items():
        assert kind in ("Chief", "Worker", "PS", "Evaluator"), kind
        assert set(spec) == {"replicas", "restartPolicy", "template"}
        assert spec["restartPolicy"] == "OnFailure"
        (container,) = spec["template"]["spec"]["containers"]
        # The operator finds the TensorFlow container by this name.
        assert container["name"] == "tensorflow"


@pytest.mark.parametrize(
    "name, trainers",
    [
        ("tfjob.yaml", ("Chief", "Worker")),
        ("tfjob-ps.yaml", ("Chief",)),
        ("trainjob.yaml", ("node",)),
    ],
)
def test_the_training_tasks_back_up_to_a_shared_volume(name, trainers):
    documents = load(name)
    train_job = [d for d in documents if d["kind"] == "TrainJob"]
    for document in documents:
        for where, template in pod_templates(document):
            if where not in trainers:
                continue
            (container,) = template["spec"]["containers"]
            command = train_job[0]["spec"]["trainer"]["command"] if train_job else []
            command = command or container["command"]
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            volumes = {v["name"]: v for v in template["spec"]["volumes"]}
            assert "persistentVolumeClaim" in volumes["backups"]
            assert f"--backup-dir={mounts['backups']}/" in " ".join(command)


def test_tfjob_chief_and_worker_build_multi_worker_mirrored():
    (job,) = load("tfjob.yaml")
    for replica_type, spec in job["spec"]["tfReplicaSpecs"].items():
        for index in range(spec["replicas"]):
            text = operator_tf_config(job, replica_type, index)
            config = cluster.parse_tf_config(text)
            assert cluster.num_training_tasks(config) == 2
            environ = {**IN_A_POD, "TF_CONFIG": text}
            choice = describe_choice(environ, num_gpus=0)
            assert choice.name == "MultiWorkerMirroredStrategy"
            assert choice.resolver == "TFConfigClusterResolver"
            assert f"this process is {replica_type.lower()}:{index}" in choice.reason
            assert cluster.detect_engine(environ).name == "Kubernetes"


def test_tfjob_parameter_server_variant():
    (job,) = load("tfjob-ps.yaml")
    for replica_type, spec in job["spec"]["tfReplicaSpecs"].items():
        for index in range(spec["replicas"]):
            text = operator_tf_config(job, replica_type, index)
            cluster.parse_tf_config(text)
            choice = describe_choice({**IN_A_POD, "TF_CONFIG": text}, num_gpus=0)
            assert choice.name == "ParameterServerStrategy"
            assert "1 `ps` task(s) and 2 worker(s)" in choice.reason
    # One script for every task: workers and parameter servers run the
    # chief's command, and auto_strategy() serves there.
    specs = job["spec"]["tfReplicaSpecs"]
    (chief,) = specs["Chief"]["template"]["spec"]["containers"]
    for serving in ("Worker", "PS"):
        (container,) = specs[serving]["template"]["spec"]["containers"]
        assert container["command"] == chief["command"]


def test_trainjob_pods_build_their_tf_config(monkeypatch):
    runtime, train_job = load("trainjob.yaml")
    assert runtime["kind"] == "TrainingRuntime" and train_job["kind"] == "TrainJob"
    assert train_job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    trainer = train_job["spec"]["trainer"]
    assert set(trainer) <= TRAINER_FIELDS, set(trainer) - TRAINER_FIELDS
    nodes = trainer["numNodes"]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert int(env["NUM_NODES"]) == nodes == runtime["spec"]["mlPolicy"]["numNodes"]
    (job,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    pod = job["template"]["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "OnFailure"
    (container,) = pod["containers"]
    (port,) = [p["containerPort"] for p in container["ports"]]
    name = train_job["metadata"]["name"]
    python, flag, code = trainer["command"]
    assert (python, flag) == ("python", "-c")

    configs, started = [], []
    monkeypatch.setattr(os, "execvp", lambda file, args: started.append(args))
    # The pod's code exports TF_CONFIG. `delenv` records nothing for a
    # variable that is not set, so without this the first pod's TF_CONFIG
    # outlived the test (and the next test built a multi-worker strategy).
    monkeypatch.setenv("TF_CONFIG", "")
    for index in range(nodes):
        # JobSet labels each pod with its name; Kubernetes gives an indexed
        # Job's pod its JOB_COMPLETION_INDEX.
        monkeypatch.setenv("JOBSET_NAME", name)
        monkeypatch.setenv("NUM_NODES", env["NUM_NODES"])
        monkeypatch.setenv("JOB_COMPLETION_INDEX", str(index))
        monkeypatch.delenv("TF_CONFIG", raising=False)
        exec(code, {})
        assert started.pop() == [
            "python",
            "examples/train.py",
            f"--backup-dir=/backups/{name}",
        ]
        configs.append(os.environ["TF_CONFIG"])

    for index, text in enumerate(configs):
        config = cluster.parse_tf_config(text)
        # The pod's DNS name under JobSet's headless service.
        assert (
            config["cluster"]["worker"][index] == f"{name}-node-0-{index}.{name}:{port}"
        )
        choice = describe_choice({**IN_A_POD, "TF_CONFIG": text}, num_gpus=0)
        assert choice.name == "MultiWorkerMirroredStrategy"
        assert f"this process is worker:{index}" in choice.reason
