"""The hosts file: what it accepts, and the message for each thing it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distributed.hosts.hostsfile import (
    DEFAULT_MASTER_PORT,
    HOST_KEYS,
    HostsConfig,
    HostsFileError,
    load_hosts,
)
from distributed.profiles.setup_files import hosts_text, write_with_backup

ROOT = Path(__file__).resolve().parents[1]

BASE = {
    "master": "10.0.0.1",
    "workers": ["10.0.0.2", "10.0.0.3"],
    "ssh_user": "alice",
    "ssh_key_path": "~/.ssh/id_ed25519",
    "python_env": "/opt/venv/bin/python",
    "project_path": "/srv/gym",
}


def problems_of(data: object) -> list[str]:
    with pytest.raises(HostsFileError) as caught:
        load_hosts(data)  # type: ignore[arg-type]
    assert isinstance(caught.value, ValueError)
    return caught.value.problems


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hosts.json"
    path.write_text(text)
    return path


def test_short_form_gives_ranks_in_order_master_first():
    config = load_hosts(BASE)
    assert [h.host for h in config.hosts] == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    assert [h.rank for h in config.hosts] == [0, 1, 2]
    assert config.master.host == "10.0.0.1"
    assert config.world_size == 3
    assert config.master_port == DEFAULT_MASTER_PORT and not config.master_port_given
    assert "master_port" not in config.to_dict()  # written back, it stays the run's to pick
    assert all(h.ssh_user == "alice" and h.python_env == "/opt/venv/bin/python"
               for h in config.hosts)
    assert config.master.ssh_port is None  # left to ~/.ssh/config, then 22


def test_per_host_object_overrides_top_level_defaults():
    data = dict(BASE, master_port=41600, workers=[
        "10.0.0.2",
        {"host": "10.0.0.3", "ssh_port": 2222, "ssh_user": "bob", "python_env": "/usr/bin/python3",
         "project_path": "/home/bob/gym", "interface": "en0", "device": "mps"},
    ], master={"host": "10.0.0.1", "device": "cuda:1"})
    config = load_hosts(data)
    worker = config.hosts[2]
    assert (worker.ssh_port, worker.ssh_user, worker.python_env, worker.project_path,
            worker.interface, worker.device) == (2222, "bob", "/usr/bin/python3", "/home/bob/gym",
                                                 "en0", "mps")
    assert config.hosts[1].ssh_user == "alice" and config.hosts[1].interface is None
    assert config.master.device == "cuda:1"
    assert config.master_port == 41600 and config.master_port_given
    assert load_hosts(config.to_dict()).master_port == 41600


def test_config_is_frozen():
    config = load_hosts(BASE)
    with pytest.raises(AttributeError):
        config.master_port = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        config.master.host = "x"  # type: ignore[misc]


def test_empty_workers_is_a_single_rank_job():
    assert load_hosts(dict(BASE, workers=[])).world_size == 1


def test_example_file_is_valid():
    config = load_hosts(ROOT / "distributed_hosts.json.example")
    assert config.world_size == 3
    assert config.hosts[2].interface == "en0"


def test_written_hosts_file_loads_back_the_same(tmp_path):
    config = load_hosts(dict(BASE, workers=["10.0.0.2", {"host": "10.0.0.3", "ssh_port": 2200}]))
    path = tmp_path / "sub" / "hosts.json"
    assert write_with_backup(path, hosts_text(config)) is None
    again = load_hosts(path)
    assert again.hosts == config.hosts
    assert again.master_port == config.master_port
    assert again.master_port_given == config.master_port_given
    assert not [p for p in path.parent.iterdir() if p.name != "hosts.json"]  # no temp file left


def test_workers_given_as_a_string_names_the_field_and_value():
    assert problems_of(dict(BASE, workers="10.0.0.2")) == [
        'hosts file: "workers" must be a list of addresses, got "10.0.0.2"']


def test_missing_master_and_workers_are_each_reported():
    data = {k: v for k, v in BASE.items() if k not in ("master", "workers")}
    found = problems_of(data)
    assert any('missing "master": add "master"' in p for p in found)
    assert any('missing "workers": add "workers"' in p for p in found)


def test_missing_python_env_names_the_hosts_lacking_it():
    data = dict(BASE, workers=["10.0.0.2", {"host": "10.0.0.3", "python_env": "/x/python"}])
    del data["python_env"]
    assert problems_of(data) == [(
        'hosts file: missing "python_env" for "master", "workers[0]": add "python_env": '
        '"/path/to/venv/bin/python" at the top level or on each of those hosts, or run '
        'setup-hosts on this file: it sets the hosts up (the project and its Python) and '
        'writes the paths in')]


def test_missing_project_path_is_reported():
    data = dict(BASE)
    del data["project_path"]
    (problem,) = problems_of(data)
    assert 'missing "project_path"' in problem and '"/path/to/checkout"' in problem


def test_unknown_key_lists_accepted_keys_and_suggests_the_close_one():
    (problem,) = problems_of(dict(BASE, workers=[{"host": "10.0.0.2", "ssh_prot": 22}]))
    assert 'unknown key "ssh_prot" in host object "workers[0]" (did you mean "ssh_port"?)' in problem
    assert "accepted keys: " + ", ".join(HOST_KEYS) in problem


def test_unknown_top_level_key_is_reported():
    (problem,) = problems_of(dict(BASE, masterport=41500))
    assert 'unknown key "masterport" in the top level (did you mean "master_port"?)' in problem


@pytest.mark.parametrize("port", [0, 70000, -1, "22", 22.5, True])
def test_bad_ssh_port_is_reported(port):
    data = dict(BASE, workers=[{"host": "10.0.0.2", "ssh_port": port}])
    assert problems_of(data) == [
        f'hosts file: "workers[0].ssh_port" must be a port number 1..65535, got {json.dumps(port)}']


def test_bad_master_port_is_reported():
    assert problems_of(dict(BASE, master_port=65536)) == [
        'hosts file: "master_port" must be a port number 1..65535, got 65536']


@pytest.mark.parametrize("key", ["ssh_user", "ssh_key_path", "python_env", "project_path"])
def test_wrong_type_of_string_field_is_reported(key):
    (problem,) = problems_of(dict(BASE, **{key: 3}))
    assert problem.startswith(f'hosts file: "{key}" must be ')
    assert problem.endswith("(a non-empty string), got 3")


def test_worker_that_is_neither_address_nor_object_is_reported():
    assert problems_of(dict(BASE, workers=[5])) == [
        'hosts file: "workers[0]" must be an address or an object with "host", got 5']


def test_host_object_without_host_is_reported():
    assert problems_of(dict(BASE, workers=[{"ssh_port": 22}])) == [
        'hosts file: "workers[0]" has no "host": add "host": "<address>" to it']


def test_user_at_host_explains_where_the_user_goes():
    assert problems_of(dict(BASE, workers=["bob@10.0.0.2"])) == [(
        'hosts file: "workers[0]" is "bob@10.0.0.2": write the address alone and the user '
        'separately: {"host": "10.0.0.2", "ssh_user": "bob"}')]


def test_host_colon_port_explains_where_the_port_goes():
    (problem,) = problems_of(dict(BASE, master="10.0.0.1:2222"))
    assert '{"host": "10.0.0.1", "ssh_port": 2222}' in problem


def test_duplicate_host_is_reported_with_both_places():
    assert problems_of(dict(BASE, workers=["10.0.0.2", "10.0.0.1"])) == [(
        'hosts file: "workers[1]" repeats host "10.0.0.1" (ssh port 22) already listed as '
        '"master": list each machine once and give it "slots" to run several ranks on it')]


def test_same_address_on_other_ssh_port_is_another_host():
    config = load_hosts(dict(BASE, workers=["10.0.0.2", {"host": "10.0.0.2", "ssh_port": 2222}]))
    assert config.world_size == 3


def test_bad_device_and_interface_are_reported():
    found = problems_of(dict(BASE, workers=[
        {"host": "10.0.0.2", "device": "gpu", "interface": "eth 0"}]))
    assert 'hosts file: "workers[0].interface" must be a network interface name such as eth0 ' \
           'or en0, got "eth 0"' in found
    assert 'hosts file: "workers[0].device" must be one of cpu, cuda, cuda:N, mps, auto, got ' \
           '"gpu"' in found


def test_every_problem_is_reported_at_once():
    data = dict(BASE, master_port=0, workers=["10.0.0.2", {"host": "10.0.0.2"}, 7], extra=1)
    found = problems_of(data)
    assert len(found) == 4
    message = str(HostsFileError(found))
    assert message.startswith("invalid hosts file (4 problems):")


def test_top_level_must_be_an_object(tmp_path):
    (problem,) = problems_of(write(tmp_path, '["10.0.0.1"]'))
    assert problem.startswith('hosts file: must be a JSON object like {"master": ')
    assert problem.endswith('got a list: ["10.0.0.1"]')


def test_invalid_json_names_line_and_column(tmp_path):
    path = write(tmp_path, '{\n  "master": "10.0.0.1"\n  "workers": []\n}\n')
    with pytest.raises(HostsFileError) as caught:
        load_hosts(path)
    (problem,) = caught.value.problems
    assert problem.startswith("hosts file line 3 column 3: invalid JSON: Expecting ',' delimiter")
    assert str(path) in str(caught.value)


def test_problems_in_a_file_carry_their_line_numbers(tmp_path):
    text = json.dumps(dict(BASE, workers=["10.0.0.2", {"host": "10.0.0.3", "ssh_port": 0}]),
                      indent=2)
    path = write(tmp_path, text)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if '"ssh_port": 0' in t)
    assert problems_of(path) == [
        f'hosts file line {line}: "workers[1].ssh_port" must be a port number 1..65535, got 0']


def test_key_given_twice_in_an_object_is_reported(tmp_path):
    text = json.dumps(BASE)[:-1] + ', "master": "10.0.0.9"}'
    (problem,) = problems_of(write(tmp_path, text))
    assert problem == 'hosts file: key "master" appears twice in the top level; keep one'


def test_missing_file_says_how_to_create_one(tmp_path):
    (problem,) = problems_of(tmp_path / "nope.json")
    assert "does not exist; create it from distributed_hosts.json.example" in problem


def test_config_type_is_exposed():
    assert isinstance(load_hosts(BASE), HostsConfig)
