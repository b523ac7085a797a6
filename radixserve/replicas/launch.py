"""`radixserve serve --replicas N`: N engine replicas as a Ray Serve application, behind this
process's HTTP server (the same app as the single server, over `front.ReplicaFront`).

The ingress is this process, not a Serve HTTP proxy: it renders, tokenizes and validates each
request once and hands the replicas token ids, so no replica re-tokenizes and the router reads
block hashes rather than text. Ray restarts a replica that dies; the ingress is the process
you run (and supervise) as with the single server.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from radixserve.config import EngineConfig
from radixserve.replicas.policy import PrefixRoutingConfig
from radixserve.server.settings import ServerSettings

if TYPE_CHECKING:  # imported when serving only, so that `radixserve --help` stays fast
    from fastapi import FastAPI

# The launch layer's `run_app(app, args, settings, stop)`: serves until drained, then calls
# `stop`; whether uvicorn started at all.
AppRunner = Callable[["FastAPI", argparse.Namespace, ServerSettings, Callable[[], None]], bool]

logger = logging.getLogger("radixserve.replicas")

APP_PREFIX = "radixserve"  # + the ingress's key: several ingresses may share a cluster
DEPLOYMENT_NAME = "engine"
# Serve polls each replica's engine snapshot (for /metrics) this often.
STATS_PERIOD_S = 1.0
# --router choices (replicas.router.router_class); "ray-prefix" is Ray's own, for comparison.
ROUTER_NAMES = ("prefix", "pow2", "round-robin", "ray-prefix")


# The replica flags and their defaults: given without --replicas, they would mean nothing.
_REPLICA_DEFAULTS = {"ray_address": None, "router": "prefix",
                     "router_imbalance_threshold": PrefixRoutingConfig.imbalance_threshold,
                     "router_min_match_tokens": PrefixRoutingConfig.min_match_tokens,
                     "cpus_per_replica": None, "replica_max_ongoing": 256}
_PREFIX_ONLY = ("router_imbalance_threshold", "router_min_match_tokens")


def add_flags(group: argparse._ArgumentGroup) -> None:
    d = _REPLICA_DEFAULTS
    group.add_argument("--replicas", type=int, default=None, metavar="N",
                       help="serve N engine replicas on Ray Serve behind this server, routed "
                            "by the prefixes each replica's cache holds; unset: one engine in "
                            "this process (needs the ray extra: pip install radixserve[ray])")
    group.add_argument("--ray-address", default=d["ray_address"], metavar="ADDR",
                       help="join this Ray cluster (e.g. ray://host:10001 or auto) instead of "
                            "starting a local one")
    group.add_argument("--router", choices=ROUTER_NAMES, default=d["router"],
                       help="prefix: longest prefix each replica's KV events show, then load; "
                            "pow2: power of two choices; round-robin; ray-prefix: Ray's own "
                            "PrefixCacheAffinityRouter (characters of routed prompts), for "
                            "comparison")
    group.add_argument("--router-imbalance-threshold", type=int,
                       default=d["router_imbalance_threshold"], metavar="N",
                       help="prefix router: a replica with more than N requests in flight "
                            "beyond the least loaded one is passed over (a miss costs a "
                            "prefix's prefill; a busier replica only shares its batched "
                            "decode steps, so N is not small)")
    group.add_argument("--router-min-match-tokens", type=int,
                       default=d["router_min_match_tokens"], metavar="TOKENS",
                       help="prefix router: a cached prefix shorter than this is not worth "
                            "following; such requests go where load is lowest")
    group.add_argument("--cpus-per-replica", type=float, default=d["cpus_per_replica"],
                       metavar="N",
                       help="Ray CPUs each replica reserves (and its torch threads, unless "
                            "--num-threads); unset: the local cluster's CPUs / N, else 1")
    group.add_argument("--replica-max-ongoing", type=int, default=d["replica_max_ongoing"],
                       metavar="N",
                       help="requests Serve sends one replica at a time (its engine queues "
                            "them)")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_single(args: argparse.Namespace) -> None:
    """Raises ValueError when a replica flag is given to the single-process server."""
    given = [_flag(k) for k, default in _REPLICA_DEFAULTS.items() if getattr(args, k) != default]
    if given:
        raise ValueError(f"{', '.join(given)} only apply with --replicas N")


def check_flags(args: argparse.Namespace) -> None:
    """Raises ValueError for flags the replicas cannot honour."""
    if args.replicas < 1:
        raise ValueError("--replicas must be >= 1")
    if args.enable_clock_control:
        raise ValueError("--enable-clock-control moves one engine's clock; it is not "
                         "available with --replicas")
    if args.next_turn_prefill and args.prefix_cache != "radix":
        raise ValueError("--next-turn-prefill keeps its prefill in the radix tree; it needs "
                         "--prefix-cache radix")
    if args.router == "prefix" and args.prefix_cache != "radix":
        raise ValueError("--router prefix follows the replicas' radix trees; it needs "
                         "--prefix-cache radix (or choose --router pow2 / round-robin)")
    if args.kv_events_endpoint or args.kv_events_replay_endpoint:
        raise ValueError("with --replicas each replica publishes its KV events on a port of "
                         "its own (GET /v1/replicas lists them); drop --kv-events-endpoint")
    ignored = [_flag(k) for k in _PREFIX_ONLY if getattr(args, k) != _REPLICA_DEFAULTS[k]]
    if args.router != "prefix" and ignored:
        raise ValueError(f"{', '.join(ignored)} set the prefix router; --router {args.router} "
                         "does not use them")
    if args.router_imbalance_threshold < 0 or args.router_min_match_tokens < 0:
        raise ValueError("--router-imbalance-threshold and --router-min-match-tokens must be "
                         ">= 0")


def serve_replicas(args: argparse.Namespace, settings: ServerSettings, config: EngineConfig,
                   run_app: AppRunner) -> int:
    """Serves `args.replicas` replicas (flags checked by `check_flags`) through `run_app`, the
    launch layer's uvicorn loop; the exit status."""
    try:
        import ray
    except ImportError:
        print("error: --replicas needs Ray: pip install 'radixserve[ray]'")
        return 2
    # Only a cluster this process started is ours to stop; a joined one keeps running (other
    # applications may be on it) and loses only our application.
    started_ray = not args.ray_address
    if args.ray_address:
        ray.init(address=args.ray_address, logging_level="warning")
    else:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="warning")
    app_name = f"{APP_PREFIX}-{uuid.uuid4().hex[:12]}"
    try:
        app, front = _deploy(args, config, settings, app_name)
    except (ValueError, RuntimeError) as exc:
        print(f"error: cannot start the replicas: {exc}")
        _teardown(app_name, started_ray)
        return 1

    def stop() -> None:
        front.shutdown()
        _teardown(app_name, started_ray)

    logger.info("serving %d replicas of %s as %s | router %s | http://%s:%d", args.replicas,
                front.facts.model_path, ", ".join(settings.served_model_names), args.router,
                args.host, args.port)
    started = run_app(app, args, settings, stop)
    logger.info("stopped")
    return 0 if started else 1


def _deploy(args: argparse.Namespace, config: EngineConfig, settings: ServerSettings,
            app_name: str) -> tuple[Any, Any]:
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from radixserve.model.loader import load_tokenizer
    from radixserve.replicas.deployment import EngineReplica
    from radixserve.replicas.front import ReplicaDirectory, ReplicaFront
    from radixserve.replicas.router import router_class
    from radixserve.replicas.routes import add_replica_routes
    from radixserve.server.app import create_app

    cpus = args.cpus_per_replica
    if cpus is None:
        total = ray.cluster_resources().get("CPU", 1.0)
        cpus = 1.0 if args.ray_address else max(1.0, total // args.replicas)
    threads = config.num_threads or max(1, int(cpus))
    # Every replica publishes its KV events (on ports of its own: deployment.EngineReplica).
    config = dataclasses.replace(config, num_threads=threads)
    actor_options: dict[str, Any] = {"num_cpus": cpus}
    # The job's runtime environment, which Serve would otherwise give the replicas itself.
    runtime_env = dict(ray.get_runtime_context().runtime_env or {})
    env_vars = dict(runtime_env.get("env_vars") or {})
    # OpenMP's wait policy, read when a replica's process starts: the job's, else this
    # process's (a replica on a cluster started elsewhere does not inherit it), else PASSIVE
    # when a replica has more threads than CPUs: its cores are shared with other replicas,
    # so workers waiting between parallel regions sleep instead of spinning on a core
    # another replica's threads need.
    policy = env_vars.get("OMP_WAIT_POLICY") or os.environ.get("OMP_WAIT_POLICY")
    if policy is None and threads > cpus:
        policy = "PASSIVE"
        logger.info("replicas run %d threads on %g CPUs each: OpenMP waits passively",
                    threads, cpus)
    if policy is not None:
        actor_options["runtime_env"] = {**runtime_env,
                                        "env_vars": {**env_vars, "OMP_WAIT_POLICY": policy}}
    kwargs: dict[str, Any] = {"ingress_key": app_name}
    if args.router == "prefix":
        kwargs.update(imbalance_threshold=args.router_imbalance_threshold,
                      min_match_tokens=args.router_min_match_tokens)
    serve.start(http_options={"location": "NoServer"})  # this process is the HTTP ingress
    deployment = serve.deployment(
        EngineReplica, name=DEPLOYMENT_NAME, num_replicas=args.replicas,
        ray_actor_options=actor_options,
        max_ongoing_requests=args.replica_max_ongoing,
        health_check_period_s=2.0, health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=10.0,
        request_router_config=RequestRouterConfig(
            request_router_class=router_class(args.router), request_router_kwargs=kwargs,
            request_routing_stats_period_s=STATS_PERIOD_S),
    )
    started = time.monotonic()
    # The next turn's prefill runs in each replica, for the turns it served (as serve.py
    # decides for one engine: on by default, with the radix cache).
    background = settings.next_turn_prefill and config.prefix_cache == "radix"
    handle = serve.run(deployment.bind(config, background), name=app_name, route_prefix=None)
    # The first call also makes Serve build the router in this process.
    facts = handle.describe.remote().result(timeout_s=120)
    logger.info("%d replicas ready in %.1f s", args.replicas, time.monotonic() - started)
    directory = ReplicaDirectory(app_name)
    tokenizer = load_tokenizer(facts.model_path)
    tokenizer.chat_template = facts.chat_template  # the one the engines render with
    front = ReplicaFront(handle, facts, tokenizer, directory,
                         with_text=args.router == "ray-prefix", background_prefill=background)
    app = create_app(front, settings, replicas=directory)
    add_replica_routes(app, directory, front)
    return app, front


def _teardown(app_name: str, started_ray: bool) -> None:
    import ray
    from ray import serve

    try:
        serve.delete(app_name)
    except Exception:  # the cluster may be gone already; nothing left to stop then
        logger.debug("serve.delete failed", exc_info=True)
    if started_ray:
        serve.shutdown()
    ray.shutdown()
