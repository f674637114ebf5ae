"""Studies: a grid of configs × seeds run as ordinary runs, scheduled on this machine's cores and
GPUs or as one SLURM array, resumable, and folded into one table beside a paper's numbers.
``python -m htfl_dist.study STUDY.yaml --out DIR`` (docs/studies.md)."""
