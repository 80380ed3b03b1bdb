"""The benchmark harness: studies, the load generator and its metrics, run as Hydra jobs that write result.json."""
