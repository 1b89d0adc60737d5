"""``infinigen serve --ray``: the same app on Ray Serve (the package's ``ray`` and ``serve`` extras), one replica
per GPU of the cluster (``--ray-replicas`` where given; one on a cluster of CPUs), each loading the model and
artifact once and running its own engine (its batches, its kept prompts, its ``/metrics``) behind Ray Serve's
HTTP proxy, which spreads the requests over them. Several machines, with Ray's own commands:

    ray start --head                       # on the first machine
    ray start --address FIRST:6379         # on each of the others
    infinigen serve MODEL --artifact A --ray-address auto --port 8000

SIGTERM (or Ctrl-C) shuts Ray Serve down, which lets each replica finish its running requests first.
"""

from __future__ import annotations

import os
import signal
import time

from infinigen.errors import InfinigenError


def serve_on_ray(load: dict, host: str, port: int, address: str | None, replicas: int) -> None:
    """Serve the engine ``Engine.load(**load)`` builds, on ``replicas`` replicas (0: one per GPU, 1 on CPUs) of
    the Ray cluster at ``address`` (None: a local one), behind Ray Serve's proxy on ``host:port``, until a
    signal."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise InfinigenError(f"--ray needs the ray extra: pip install 'infinigen[ray,serve]' ({exc})") from None
    # Ray Serve restarts a proxy not ready within 5 s: on a busy host a new one is no faster (a local cluster's
    # processes see this process's environment; a running cluster keeps its own)
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    ray.init(address=address, log_to_driver=False)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    count = replicas or max(gpus, 1)

    def build():  # in each replica, as it starts: the model and artifact loaded there, once
        from infinigen.serve.app import make_app
        from infinigen.serve.engine import Engine

        return make_app(Engine.load(**load))

    class Replica:  # its app is ``build``'s
        pass

    options = {"num_gpus": 1} if gpus else {"num_cpus": 1}
    deployment = serve.deployment(serve.ingress(build)(Replica), name="infinigen", ray_actor_options=options)
    serve.start(http_options={"host": host, "port": port})
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        serve.run(deployment.options(num_replicas=count).bind(), name="infinigen", route_prefix="/")
        print(f"serving on Ray: {count} replicas at http://{host}:{port}/v1; SIGTERM stops them", flush=True)
        while not stopping:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
