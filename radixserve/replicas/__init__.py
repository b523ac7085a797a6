"""radixserve replicas on Ray Serve: N engines behind one HTTP ingress, routed by the prefixes
each replica's radix tree really holds (its KV events), then by load.

- `job`: what the ingress sends a replica (token ids, namespace, block hashes).
- `deployment`: the replica, an engine in a Ray Serve deployment.
- `router`: the request routers (prefix-aware, power of two, round robin).
- `front`: the ingress's side: the server's engine front over the replicas.
- `routes`: GET /v1/replicas and POST /v1/replicas/match, added to the ingress's app.
- `launch`: `radixserve serve --replicas N` (its flags, and the deployment the launch layer,
  `radixserve.serve`, starts).

Ray is an optional extra (`pip install radixserve[ray]`); the server imports nothing from here.
"""
