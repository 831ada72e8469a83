"""The model control plane: what workers published, the registered models, which names are served by
which instance, placement of loads, routing of jobs to prefill workers, the reconciler and the model
admin API."""
