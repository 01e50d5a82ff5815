"""The control plane: replicas' lifecycles on local processes (and later Ray, Kubernetes)."""
