"""Hydra plugins for inferlab's harness (found by Hydra's plugin scan of the `hydra_plugins` namespace)."""
