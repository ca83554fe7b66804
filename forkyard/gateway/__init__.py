"""Cluster mode's gateway (docs/CLUSTER.md): places sandboxes on nodes and forwards to them."""
