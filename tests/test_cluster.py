"""Tests for keras_dist.cluster: TF_CONFIG building and validation."""

import json
import logging
import re
import socket
import threading
import time

import numpy as np
import pytest
from helpers import run_python

from keras_dist import cluster

SPEC = {"chief": ["localhost:2222"], "worker": ["localhost:2223", "host-b:2224"]}


def _tf_config(cluster_spec, task=None):
    config = {"cluster": cluster_spec}
    if task is not None:
        config["task"] = task
    return json.dumps(config)


def test_parse_valid_config_returns_dict():
    text = _tf_config(SPEC, {"type": "worker", "index": 1})
    assert cluster.parse_tf_config(text) == json.loads(text)


def test_parse_without_task_is_allowed():
    assert cluster.parse_tf_config(_tf_config(SPEC))["cluster"] == SPEC


def test_parse_task_index_defaults_to_zero():
    config = cluster.parse_tf_config(_tf_config(SPEC, {"type": "chief"}))
    assert config["task"] == {"type": "chief"}


def test_parse_reads_environment(monkeypatch):
    text = _tf_config(SPEC, {"type": "chief", "index": 0})
    monkeypatch.setenv("TF_CONFIG", text)
    assert cluster.parse_tf_config() == json.loads(text)


@pytest.mark.parametrize("value", [None, "", "   "])
def test_parse_unset_environment_returns_none(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", value)
    assert cluster.parse_tf_config() is None


def test_parse_not_json():
    with pytest.raises(ValueError, match=r"from the argument is not valid JSON"):
        cluster.parse_tf_config("{cluster: nope}")


def test_parse_not_json_names_environment_variable(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "not json")
    with pytest.raises(ValueError, match=r"TF_CONFIG environment variable .* JSON"):
        cluster.parse_tf_config()


@pytest.mark.parametrize("text", ["[1, 2]", '"worker"', "3"])
def test_parse_not_an_object(text):
    with pytest.raises(ValueError, match=r"must be a JSON object"):
        cluster.parse_tf_config(text)


@pytest.mark.parametrize(
    "config",
    [{}, {"cluster": {}}, {"cluster": ["localhost:1"]}, {"task": {"type": "worker"}}],
)
def test_parse_missing_cluster(config):
    with pytest.raises(ValueError, match=r"has no `cluster`"):
        cluster.parse_tf_config(json.dumps(config))


def test_parse_unknown_task_type_in_cluster():
    with pytest.raises(ValueError, match=r"unknown task type 'master'"):
        cluster.parse_tf_config(_tf_config({"master": ["localhost:1"]}))


@pytest.mark.parametrize("addresses", [[], "localhost:1", None])
def test_parse_addresses_must_be_non_empty_list(addresses):
    with pytest.raises(ValueError, match=r"cluster\['worker'\] must be a non-empty"):
        cluster.parse_tf_config(_tf_config({"worker": addresses}))


@pytest.mark.parametrize("address", ["localhost", 2222, ""])
def test_parse_address_without_port(address):
    with pytest.raises(ValueError, match=r"not a 'host:port' string"):
        cluster.parse_tf_config(_tf_config({"worker": [address]}))


@pytest.mark.parametrize("address", ["localhost:http", "localhost:0", "h:65536"])
def test_parse_address_with_bad_port(address):
    with pytest.raises(ValueError, match=r"has no valid port \(1-65535\)"):
        cluster.parse_tf_config(_tf_config({"worker": [address]}))


def test_parse_two_chiefs():
    spec = {"chief": ["localhost:1", "localhost:2"], "worker": ["localhost:3"]}
    with pytest.raises(ValueError, match=r"at most one `chief`"):
        cluster.parse_tf_config(_tf_config(spec))


def test_parse_task_not_an_object():
    with pytest.raises(ValueError, match=r"`task` must be an object"):
        cluster.parse_tf_config(_tf_config(SPEC, task=["worker", 0]))


def test_parse_unknown_task_type_in_task():
    with pytest.raises(ValueError, match=r"task type 'master' is unknown"):
        cluster.parse_tf_config(_tf_config(SPEC, {"type": "master", "index": 0}))


@pytest.mark.parametrize("index", ["0", 1.0, True])
def test_parse_task_index_must_be_integer(index):
    with pytest.raises(ValueError, match=r"task index must be an integer"):
        cluster.parse_tf_config(_tf_config(SPEC, {"type": "worker", "index": index}))


@pytest.mark.parametrize("index", [2, -1])
def test_parse_task_index_out_of_range(index):
    with pytest.raises(ValueError, match=r"out of range for 'worker'.*0\.\.1"):
        cluster.parse_tf_config(_tf_config(SPEC, {"type": "worker", "index": index}))


def test_parse_task_type_not_in_cluster():
    with pytest.raises(ValueError, match=r"task type 'ps' is not in its cluster"):
        cluster.parse_tf_config(_tf_config(SPEC, {"type": "ps", "index": 0}))


def test_parse_evaluator_outside_cluster_is_allowed():
    text = _tf_config(SPEC, {"type": "evaluator", "index": 0})
    assert cluster.parse_tf_config(text)["task"]["type"] == "evaluator"


def test_parse_evaluator_inside_cluster_is_checked():
    spec = dict(SPEC, evaluator=["localhost:4000"])
    assert cluster.parse_tf_config(_tf_config(spec, {"type": "evaluator"}))
    with pytest.raises(ValueError, match=r"out of range for 'evaluator'"):
        cluster.parse_tf_config(_tf_config(spec, {"type": "evaluator", "index": 1}))


def test_num_training_tasks():
    assert cluster.num_training_tasks(None) == 0
    assert cluster.num_training_tasks({"cluster": SPEC}) == 3
    spec = {"worker": ["a:1"], "ps": ["b:1", "c:1"], "evaluator": ["d:1"]}
    assert cluster.num_training_tasks({"cluster": spec}) == 1


def test_free_ports_are_distinct_and_bindable():
    ports = cluster.free_ports(5)
    assert len(set(ports)) == 5
    for port in ports:
        assert 0 < port < 65536
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))


@pytest.mark.parametrize("count", [0, -1])
def test_free_ports_rejects_bad_count(count):
    with pytest.raises(ValueError, match=r"`count` must be an int >= 1"):
        cluster.free_ports(count)


@pytest.mark.parametrize("count", [1.5, "2", True])
def test_free_ports_rejects_non_int_count(count):
    with pytest.raises(TypeError, match=r"`count` must be an int >= 1"):
        cluster.free_ports(count)


def test_free_ports_accepts_numpy_ints():
    assert len(cluster.free_ports(np.int64(2))) == 2


def test_local_cluster_workers_only():
    spec = cluster.local_cluster(workers=3)
    assert list(spec) == ["worker"]
    assert len(spec["worker"]) == 3
    assert all(address.startswith("localhost:") for address in spec["worker"])


def test_local_cluster_full_layout_has_distinct_ports():
    spec = cluster.local_cluster(workers=2, ps=2, chief=True, host="127.0.0.1")
    assert {name: len(tasks) for name, tasks in spec.items()} == {
        "chief": 1,
        "worker": 2,
        "ps": 2,
    }
    addresses = [address for tasks in spec.values() for address in tasks]
    assert len(set(addresses)) == 5
    assert all(address.startswith("127.0.0.1:") for address in addresses)


def test_local_cluster_chief_without_workers():
    spec = cluster.local_cluster(workers=0, chief=True)
    assert list(spec) == ["chief"]


def test_local_cluster_needs_a_training_task():
    with pytest.raises(
        ValueError, match=r"`workers` must be an int >= 1\. .* at least one task"
    ):
        cluster.local_cluster(workers=0)
    with pytest.raises(ValueError, match=r"`workers` must be an int >= 0"):
        cluster.local_cluster(workers=-1, chief=True)


@pytest.mark.parametrize("workers", [2.0, "2", True])
def test_local_cluster_rejects_non_int_workers(workers):
    with pytest.raises(TypeError, match=r"`workers` must be an int"):
        cluster.local_cluster(workers=workers)


def test_local_cluster_rejects_bad_ps():
    with pytest.raises(ValueError, match=r"`ps` must be an int >= 0"):
        cluster.local_cluster(workers=1, ps=-1)


@pytest.mark.parametrize("ps", [1.0, True])
def test_local_cluster_rejects_non_int_ps(ps):
    with pytest.raises(TypeError, match=r"`ps` must be an int >= 0"):
        cluster.local_cluster(workers=1, ps=ps)


@pytest.mark.parametrize("chief", ["no", 1, None])
def test_local_cluster_chief_must_be_a_bool(chief):
    # A truthy string used to add a chief.
    with pytest.raises(TypeError, match=r"`chief` must be a bool\. Received: chief="):
        cluster.local_cluster(workers=1, chief=chief)


def test_local_cluster_accepts_numpy_counts():
    spec = cluster.local_cluster(np.int64(2), ps=np.int32(1), chief=np.bool_(True))
    assert {name: len(tasks) for name, tasks in spec.items()} == {
        "chief": 1,
        "worker": 2,
        "ps": 1,
    }


def test_free_ports_says_when_file_descriptors_run_out():
    # A child with a descriptor limit of 32 asks for 100 sockets at once.
    code = """
        import resource, sys
        # Imported as the command line imports it, without TensorFlow.
        sys.argv[0] = "-m"
        from keras_dist import cluster
        resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
        try:
            cluster.free_ports(100)
        except OSError as error:
            print(error)
    """
    result = run_python(code, timeout=60)
    assert re.search(
        r"cannot hold 100 free ports at once: the process ran out of file "
        r"descriptors after \d+ .*`ulimit -n 4096`",
        result.stdout,
    ), result.stdout


@pytest.mark.parametrize(
    ("task_type", "task_index"), [("chief", 0), ("worker", 0), ("worker", 1)]
)
def test_make_tf_config_round_trip(task_type, task_index):
    spec = cluster.local_cluster(workers=2, chief=True)
    text = cluster.make_tf_config(spec, task_type, task_index)
    assert cluster.parse_tf_config(text) == {
        "cluster": spec,
        "task": {"type": task_type, "index": task_index},
    }


def test_make_tf_config_validates():
    spec = cluster.local_cluster(workers=2)
    with pytest.raises(ValueError, match=r"out of range"):
        cluster.make_tf_config(spec, "worker", 2)
    with pytest.raises(ValueError, match=r"not in its cluster"):
        cluster.make_tf_config(spec, "chief", 0)


@pytest.mark.parametrize(
    ("spec", "address", "tasks"),
    [
        (
            {"worker": ["localhost:2001", "localhost:2001"]},
            "localhost:2001",
            "worker:0, worker:1",
        ),
        (
            {"chief": ["Host-A:2000"], "worker": ["host-a:2000"]},
            "host-a:2000",
            "chief:0, worker:0",
        ),
        ({"worker": ["h:1"], "ps": ["h:2", "h:01"]}, "h:1", "worker:0, ps:1"),
    ],
)
def test_parse_duplicate_addresses(spec, address, tasks):
    with pytest.raises(
        ValueError,
        match=rf"gives the address '{address}' to 2 tasks \({tasks}\)\. Every "
        r"task needs its own 'host:port'",
    ):
        cluster.parse_tf_config(_tf_config(spec, {"type": "worker", "index": 0}))


# wait_for_cluster: plain sockets on localhost, no TensorFlow.


def _listening_socket():
    server = socket.create_server(("127.0.0.1", 0))
    return server, f"localhost:{server.getsockname()[1]}"


def test_wait_for_cluster_returns_when_every_peer_answers():
    server, address = _listening_socket()
    with server:
        spec = {"chief": [address], "worker": [f"localhost:{cluster.free_ports(1)[0]}"]}
        cluster.wait_for_cluster(spec, 5, "worker", 0)


def test_wait_for_cluster_skips_other_task_types():
    port = cluster.free_ports(1)[0]
    spec = {"worker": [f"localhost:{port}"], "ps": [f"localhost:{port + 1}"]}
    cluster.wait_for_cluster(spec, 5, "worker", 0)


def test_wait_for_cluster_names_missing_tasks_and_logs_progress(caplog):
    ports = cluster.free_ports(3)
    spec = {"worker": [f"localhost:{port}" for port in ports]}
    start = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, logger="keras_dist.cluster"),
        pytest.raises(
            RuntimeError,
            match=rf"Timed out after 1\.5 s waiting for the cluster to start: "
            rf"worker:1 at localhost:{ports[1]} \(.*\), worker:2 at "
            rf"localhost:{ports[2]} \(.*\) did not answer\. This process is "
            r"worker:0\. Start every task .*startup_timeout=.*"
            r"KERAS_DIST_STARTUP_TIMEOUT",
        ),
    ):
        cluster.wait_for_cluster(spec, 1.5, "worker", 0, log_interval=0.5)
    assert time.monotonic() - start < 5
    assert "Still waiting for 2 task(s) of the cluster after" in caplog.text
    assert f"worker:2 at localhost:{ports[2]}" in caplog.text


def test_wait_for_cluster_outside_the_cluster_only_probes():
    port = cluster.free_ports(1)[0]
    with pytest.raises(RuntimeError, match=r"worker:0 at .* did not answer\. Check"):
        cluster.wait_for_cluster({"worker": [f"localhost:{port}"]}, 0.5)


def test_wait_for_cluster_tasks_started_apart_find_each_other():
    # Each task's "TensorFlow server" (a plain listener here) starts only
    # after its wait returns, as in `auto_strategy`: the stand-in listeners
    # let tasks started at different times find each other instead of
    # waiting for each other's servers.
    spec = cluster.local_cluster(workers=3)
    servers, errors = [], []
    done = threading.Event()

    def task(index, delay):
        time.sleep(delay)
        try:
            cluster.wait_for_cluster(spec, 20, "worker", index)
        except Exception as error:  # reported below
            errors.append(error)
            return
        port = int(spec["worker"][index].rsplit(":", 1)[1])
        with socket.create_server(("localhost", port)) as server:
            servers.append(server)
            done.wait(30)

    threads = [
        threading.Thread(target=task, args=(index, 1.5 * index)) for index in range(3)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while len(servers) + len(errors) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    done.set()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert len(servers) == 3


def test_wait_for_cluster_works_when_its_own_port_is_taken():
    server, address = _listening_socket()
    with server:
        peer, peer_address = _listening_socket()
        with peer:
            cluster.wait_for_cluster(
                {"worker": [address, peer_address]}, 5, "worker", 0
            )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"timeout": 0}, ValueError, r"`timeout` must be a finite number > 0"),
        ({"timeout": "5"}, TypeError, r"timeout='5'"),
        ({"timeout": 1, "log_interval": float("inf")}, ValueError, r"log_interval"),
    ],
)
def test_wait_for_cluster_checks_its_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        cluster.wait_for_cluster({"worker": ["localhost:1"]}, **kwargs)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("LOCALHOST", True),
        ("127.0.0.1", True),
        ("::1", True),
        ("10.0.0.5", False),
        ("host-b", False),
    ],
)
def test_only_loopback_addresses_keep_the_stand_in_listener_on_loopback(host, loopback):
    # A host name may map to 127.0.1.1 here while the other hosts reach it
    # by its real address: the stand-in listener must then bind every
    # interface, as TensorFlow's server does.
    assert cluster._is_loopback_name(host) is loopback


def test_stand_in_listener_for_localhost_binds_loopback_only():
    port = cluster.free_ports(1)[0]
    listeners = cluster._listen(f"localhost:{port}")
    try:
        assert listeners
        for listener in listeners:
            assert listener.getsockname()[0] in ("127.0.0.1", "::1")
    finally:
        for listener in listeners:
            listener.close()
