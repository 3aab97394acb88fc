"""rebar on Ray Serve: the same ASGI app as `rebar serve`, as a deployment of N replicas behind
Ray Serve's HTTP proxy.

Each replica builds rebar's app from the settings (its own engines and registry) and starts
taking traffic once its pinned models are loaded; Ray checks its health with the same test as
`/ready`, drains it on shutdown for `server.drain_timeout_s`, and restarts one that dies. Replicas
share the `[store]` (use Redis): the caches, the rate limits and model reloads over pub/sub reach
every replica. Responses name the replica that served them in `X-Rebar-Replica`.

`rebar serve --ray` runs it; `deploy/ray/serve_config.yaml` deploys the same application with
`serve deploy` or KubeRay (`import_path: rebar.ray_serve:build_app`).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from ray.serve import Application

from ray import serve
from rebar.config import Settings, load_settings

logger = logging.getLogger("rebar.ray")

APP_NAME = "rebar"
REPLICA_HEADER = b"x-rebar-replica"


class _ReplicaHeaders:
    """Adds `X-Rebar-Replica: <replica id>` to every HTTP response of this replica, and leaves
    `X-Request-ID` to Ray's proxy: it passes rebar the id (the client's, or its own) and adds the
    header itself, so rebar's copy would send it twice."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app, self.replica = app, replica.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message["headers"] if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (REPLICA_HEADER, self.replica)]}
            await send(message)

        await self.app(scope, receive, send_with_header)


@serve.ingress()
class RebarReplica:
    """One replica: rebar's app on `settings`, built when Ray starts the replica."""

    def __init__(self, settings: Settings) -> None:
        from rebar.obs.logs import configure_logging

        self.settings = settings
        configure_logging(settings.logging.level, settings.logging.format)
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    def __serve_build_asgi_app__(self) -> Any:
        from rebar.server.app import create_app

        self.rebar_app = create_app(self.settings, load_before_serving=True)
        return _ReplicaHeaders(self.rebar_app, self.replica_id)

    def check_health(self) -> None:
        """Raises (Ray restarts the replica) once it cannot serve: a model failed to load or an
        engine process exited."""
        registry = self.rebar_app.state.rebar.registry
        failure = registry.engine_failure() or registry.load_error
        if failure is not None:
            raise RuntimeError(failure)


def deployment_options(settings: Settings) -> dict[str, Any]:
    """Ray Serve's deployment options for `settings.ray` (replicas or autoscaling, per-replica
    limits, health checks, the drain)."""
    ray = settings.ray
    options: dict[str, Any] = {
        "name": "RebarReplica",
        "max_ongoing_requests": ray.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": ray.num_cpus},
        "health_check_period_s": ray.health_check_period_s,
        "graceful_shutdown_timeout_s": settings.server.drain_timeout_s,
        "graceful_shutdown_wait_loop_s": 1.0,
    }
    if ray.autoscaling:
        options["autoscaling_config"] = {
            "min_replicas": ray.min_replicas,
            "max_replicas": ray.max_replicas,
            "target_ongoing_requests": ray.target_ongoing_requests,
        }
    else:
        options["num_replicas"] = ray.num_replicas
    return options


def application(settings: Settings) -> Application:
    deployment = serve.deployment(**deployment_options(settings))(RebarReplica)
    return deployment.bind(settings)


def build_app(args: dict[str, Any]) -> Application:
    """The application builder for Serve config files: `args.config` is a rebar.toml (optional;
    `REBAR_*` variables apply as usual)."""
    config = args.get("config")
    return application(load_settings(config))


def run(settings: Settings) -> None:
    """`rebar serve --ray`: deploy on the cluster (`ray.address`, or a new local one) with the
    proxy on `server.host`:`server.port`, until SIGTERM/SIGINT; then drain and shut down."""
    import ray as ray_core

    ray_core.init(address=settings.ray.address, include_dashboard=False, log_to_driver=False)
    stop = threading.Event()  # from here on a signal means: drain and stop, even mid-deploy
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    serve.start(http_options={"host": settings.server.host, "port": settings.server.port})
    serve.run(application(settings), name=APP_NAME, route_prefix="/")
    logger.info(
        "serving on http://%s:%d through Ray Serve", settings.server.host, settings.server.port
    )
    stop.wait()
    logger.info("shutting down: draining replicas")
    serve.delete(APP_NAME)  # waits for each replica's graceful shutdown
    serve.shutdown()
    ray_core.shutdown()
