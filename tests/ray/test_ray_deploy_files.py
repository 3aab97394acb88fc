"""deploy/ray: the Serve config validates against Ray Serve's own schema, the KubeRay RayService
carries the same application, and `rebar serve --ray` starts, serves and stops cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from live_server import free_port
from markers import requires_smollm2
from suite_tiers import limit

pytestmark = limit("cluster")  # tests/suite_tiers.py

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "ray"


def test_the_serve_config_is_valid_for_ray_serve_and_builds_rebar(tmp_path: Path) -> None:
    from ray.serve.schema import ServeDeploySchema

    import ray
    from rebar.ray_serve import build_app, deployment_options

    config = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.parse_obj(config)  # raises on an unknown or ill-typed field
    app = schema.applications[0]
    assert app.import_path == "rebar.ray_serve:build_app" and app.route_prefix == "/"
    names = {d["name"] for d in config["applications"][0]["deployments"]}
    assert names == {deployment_options(_settings(tmp_path))["name"]}
    assert ray.__version__ == "2.60.0"
    toml = tmp_path / "rebar.toml"
    toml.write_text('[models]\nembedding = ""\n[ray]\nnum_replicas = 3\n')
    built = build_app({"config": str(toml)})
    assert built._bound_deployment.num_replicas == 3


def test_the_rayservice_manifest_runs_the_same_application() -> None:
    from ray.serve.schema import ServeDeploySchema

    manifest = yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    embedded = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert embedded == yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    ServeDeploySchema.parse_obj(embedded)
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0"
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {p["containerPort"] for p in head["ports"]} >= {8000, 6379}
    for group in cluster["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_autoscaling_settings_become_ray_serves_autoscaling_config(tmp_path: Path) -> None:
    from ray.serve.schema import DeploymentSchema

    from rebar.config import load_settings
    from rebar.ray_serve import deployment_options

    settings = load_settings(
        None,
        {
            "ray.autoscaling": True,
            "ray.min_replicas": 2,
            "ray.max_replicas": 6,
            "ray.target_ongoing_requests": 8,
            "server.drain_timeout_s": 12,
        },
    )
    options = deployment_options(settings)
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {
        "min_replicas": 2,
        "max_replicas": 6,
        "target_ongoing_requests": 8.0,
    }
    assert options["graceful_shutdown_timeout_s"] == 12
    DeploymentSchema.parse_obj(options)  # what Ray Serve accepts
    assert deployment_options(_settings(tmp_path))["num_replicas"] == 1


def _settings(tmp_path: Path):
    from rebar.config import load_settings

    return load_settings(None, {})


@requires_smollm2
def test_rebar_serve_ray_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "rebar.toml"
    config.write_text(
        '[models]\nembedding = ""\n[engine]\nmax_model_len = 512\nkv_cache_memory = 33554432\n'
        "num_threads = 1\n[ray]\nnum_replicas = 1\nnum_cpus = 0.5\n[server]\ndrain_timeout_s = 5\n"
    )
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REBAR_")}
    with open(log, "w") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rebar.cli",
                "serve",
                "--ray",
                "--config",
                str(config),
                "--port",
                str(port),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        reply = None
        while time.monotonic() < deadline and process.poll() is None:
            try:
                reply = httpx.post(
                    url + "/v1/completions",
                    json={"model": "smollm2", "prompt": "Hello", "max_tokens": 2},
                    timeout=30,
                )
                if reply.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        assert reply is not None and reply.status_code == 200, log.read_text()[-3000:]
        assert reply.headers["x-rebar-model-version"] == "smollm2-v1"
        assert reply.headers["x-rebar-replica"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(90) == 0, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_replica_reports_unhealthy_once_a_model_failed_or_an_engine_exited() -> None:
    from types import SimpleNamespace

    import pytest

    from rebar.ray_serve import RebarReplica

    registry = SimpleNamespace(load_error=None, engine_failure=lambda: None)
    state = SimpleNamespace(registry=registry)
    replica = SimpleNamespace(rebar_app=SimpleNamespace(state=SimpleNamespace(rebar=state)))
    RebarReplica.check_health(replica)  # healthy: returns
    registry.load_error = "models.chat: no such file"
    with pytest.raises(RuntimeError, match="no such file"):
        RebarReplica.check_health(replica)
    registry.load_error = None
    registry.engine_failure = lambda: "the engine process exited (exit code -9)"
    with pytest.raises(RuntimeError, match="exit code -9"):
        RebarReplica.check_health(replica)
