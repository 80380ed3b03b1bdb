"""Serving replicas of the engine on Ray Serve (the `replicas` extra): one engine per replica behind the server's
own FastAPI app as the ingress, with prefix-affine routing between them. Nothing here is imported by the server
itself; `inferlab-serve-replicas` (serve_replicas.py) starts it."""
