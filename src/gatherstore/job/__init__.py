"""The job: process groups and their state, control plane, sessions, launch, SLURM, signals."""
