"""A request is resolved once: the profile (with its --set values), the hosts file and the
faults are read and checked one time, and everything downstream reads that resolution."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from cli_typer import app
from distributed.app import run

runner = CliRunner()


def counting(monkeypatch) -> dict[str, int]:
    calls = {"profile": 0, "hosts": 0}
    load_profile, load_hosts = run.load_profile, run.load_hosts

    def profile(*args, **kwargs):
        calls["profile"] += 1
        return load_profile(*args, **kwargs)

    def hosts(*args, **kwargs):
        calls["hosts"] += 1
        return load_hosts(*args, **kwargs)

    monkeypatch.setattr(run, "load_profile", profile)
    monkeypatch.setattr(run, "load_hosts", hosts)
    return calls


def test_a_dry_run_resolves_its_profile_once(monkeypatch, tmp_path):
    calls = counting(monkeypatch)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["distributed-train", "digits-diloco", "--set", "H=5",
                                 "--set", "max_steps=20", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert calls == {"profile": 1, "hosts": 0}


def test_a_run_across_hosts_resolves_profile_hosts_and_faults_once(monkeypatch, tmp_path):
    calls = counting(monkeypatch)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({"master": "127.0.0.1", "workers": ["127.0.0.2"],
                                 "ssh_user": "root", "project_path": str(tmp_path),
                                 "python_env": "/usr/bin/python3"}))
    request = run.TrainRequest(profile="digits-diloco", overrides={"H": 5, "max_steps": 40},
                               hosts=str(hosts), inject=("kill:1@step=10",), max_restarts=1)
    resolved = run.resolve(request)
    assert run.resolve(request) is resolved
    assert run.resolve_profile(request) is resolved.profile
    assert run.hosts_config(request) is resolved.hosts
    assert run.fault_plan(request) is resolved.faults is not None
    assert (resolved.num_nodes, resolved.strategy) == (2, "diloco")
    assert calls == {"profile": 1, "hosts": 1}
    ddp = run.resolve(run.TrainRequest(profile="digits-ddp",
                                       overrides={"strategy": "allreduce"}))
    assert ddp.strategy == "ddp" and ddp.num_nodes == ddp.profile.num_nodes
